"""Helpers for the corpus-build tests: run a build on the real runners and read its outputs back."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

from ember.pipelines.corpus.config import CorpusConfig, check_inputs
from ember.pipelines.corpus.phases import cache_root
from ember.pipelines.corpus.pipeline import run
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE

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


def forget_build(output: Path) -> None:
    """Make the next build of `output` run both phases again (no phase cache, no build key): a rerun of an
    unchanged config is otherwise skipped as up to date (tests/pipelines/jobs/test_interrupt_resume.py)."""
    ownership = output / OWNERSHIP_FILE
    payload = json.loads(ownership.read_text())
    payload.pop("build_key", None)
    ownership.write_text(json.dumps(payload, indent=1) + "\n")
    shutil.rmtree(cache_root(output), ignore_errors=True)
