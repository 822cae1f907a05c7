"""A small build pays Beam's fixed cost once: its two phases run fused as one Beam job, counted from the job
log's own lines, in the one job process that also runs its tokenize job, and write the same bytes and the same
reusable cache entry as the two-job (split) build."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.cli import app
from ember.pipelines.corpus.build import build_corpus, local_input_bytes
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.phases import cache_root, verified
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE
from ember.pipelines.jobs.runners import SMALL_INPUT_BYTES

from tests.pipelines.corpus_support import IN_PROCESS, file_digests

TOKENIZE = {"tokenizer": {"name": "cl100k_base"}, "seq_len": 128, "sequences_per_shard": 4}
JOB_LINE = re.compile(r"beam job started: (.+) on (\w+) in process (\d+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("fused-input"))


def cli_build(sample: SampleCorpus, out: Path, *options: str) -> list[tuple[str, str]]:
    """`ember corpus build` with a tokenize section; the Beam jobs it ran, as (what, runner), from `<out>.log`,
    each in the same job process, not this one."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump({**sample.config(str(out)), "tokenize": TOKENIZE}))
    result = CliRunner().invoke(app, ["build", str(config), *options])
    assert result.exit_code == 0, result.output
    jobs = JOB_LINE.findall(out.with_name(f"{out.name}.log").read_text())
    assert len({pid for _, _, pid in jobs}) == 1 and jobs[0][2] != str(os.getpid()), jobs
    return [(what, runner) for what, runner, _ in jobs]


def outputs(out: Path) -> dict[str, str]:
    """Every file's digest but those that record when or how they were made (report, ownership, manifest)."""
    return {k: v for k, v in file_digests(out).items()
            if k not in ("report.md", "report.html", OWNERSHIP_FILE, "shards/manifest.json")}


def test_a_small_build_is_one_beam_job_in_process_and_writes_what_the_split_build_writes(
    sample: SampleCorpus, tmp_path: Path
) -> None:
    assert local_input_bytes(parse_config(sample.config(str(tmp_path)))) <= SMALL_INPUT_BYTES
    fused = cli_build(sample, tmp_path / "fused")
    assert fused == [("phases documents + output", "FnApiRunner"), ("tokenize", "FnApiRunner")]
    split = cli_build(sample, tmp_path / "split", "--phases=split")
    assert split == [("phase documents", "FnApiRunner"), ("phase output", "FnApiRunner"), ("tokenize", "FnApiRunner")]
    assert outputs(tmp_path / "fused") == outputs(tmp_path / "split")
    assert any(name.startswith("shards/shard-") for name in outputs(tmp_path / "fused"))

    entries = {root: [(p.name, verified(p) is not None) for p in cache_root(tmp_path / root).iterdir()]
               for root in ("fused", "split")}
    assert entries["fused"] == entries["split"] and entries["fused"][0][1], "the fused job leaves the same sealed entry"


def test_the_fused_builds_cache_entry_lets_a_dedup_change_skip_the_documents_phase(sample: SampleCorpus,
                                                                                    tmp_path: Path) -> None:
    raw = sample.config(str(tmp_path / "out"))
    first = build_corpus(parse_config(raw), IN_PROCESS)
    assert first.phases == {"documents": "ran", "output": "ran"}
    changed = build_corpus(parse_config({**raw, "dedup": {"near": False}}), IN_PROCESS)
    assert changed.phases == {"documents": "skipped", "output": "ran"}
    assert changed.stats["totals"]["docs_in"] == first.stats["totals"]["docs_in"]
    elsewhere = {**raw, "dedup": {"near": False}, "output": {**raw["output"], "directory": str(tmp_path / "ref")}}
    reference = build_corpus(parse_config(elsewhere), IN_PROCESS, phases_plan="split")
    assert reference.phases == {"documents": "ran", "output": "ran"}
    assert outputs(tmp_path / "out") == outputs(tmp_path / "ref")
