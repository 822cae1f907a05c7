"""Helpers for the corpus-build tests: run a build on the real runners and read its outputs back."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

from ember.pipelines.corpus_config import CorpusConfig, check_inputs
from ember.pipelines.corpus_pipeline import run

IN_PROCESS = ["--runner=FnApiRunner"]


def build(config: CorpusConfig, args: list[str] = IN_PROCESS) -> str:
    check_inputs(config)
    return run(config, PipelineOptions(args))


def file_digests(directory: Path) -> dict[str, str]:
    """Every output file's sha256, keyed by its path under `directory`."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def rows(directory: Path, name: str) -> list[dict]:
    found = []
    for path in sorted((directory / name).rglob("*.parquet")):
        found += pq.read_table(path).to_pylist()
    return found
