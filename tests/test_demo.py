"""The main job end to end: `ember demo` on its embedded defaults, against the real services.

The one run is checked stage by stage from what it left (summary.json, the stages' files, the loop's topics): the
corpus stage and the closed RL loop are asserted here rather than run again by tests of their own (~110 s saved).
"""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from ember.demo.loop_stage import GRADER, GROUP_SIZE, LoopRecords, read_records
from ember.pipelines.corpus.report import read_stats
from ember.schemas.documents import DOCUMENT_SCHEMA

REPO = Path(__file__).resolve().parents[1]
# Every stage of the main job on two shared cores: as long as the subprocess may take, not the suite's 600 s default.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def demo(kafka, slurm) -> tuple[str, Path, dict[str, str]]:
    """`ember demo`'s output, its work directory and every stage's summary rows."""
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "demo"], cwd=REPO, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "demo OK" in out, out[-6000:]
    workdir = Path(re.search(r"^demo work directory: (.+)$", out, re.MULTILINE).group(1))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["ok"], summary
    return out, workdir, {key: value for stage in summary["stages"] for key, value in stage["rows"].items()}


def test_demo_runs_every_stage_and_its_checks_hold(demo):
    out, _, _ = demo
    for row in ("records read back equal", "corpus accounted (in = kept + rejected)", "verify", "midtrain loss per step",
                "books balance", "rl routing vs sampler (tokens differing)", "slurm job"):
        assert row in out, f"the demo summary lacks '{row}'"
    assert "FAILED" not in out
    loop = next((line for line in out.splitlines() if line.startswith("loop: ")), "")
    assert "versions gone round" in loop and "decided once: yes" in loop and "sha256 = trainer's export: yes" in loop, out[-6000:]


def test_the_corpus_stage_builds_documents_and_a_verified_shard_set(demo):
    _, workdir, values = demo
    stats = read_stats(str(workdir / "corpus"))
    assert values["corpus documents in"] == f"{stats['totals']['docs_in']:,}" and stats["totals"]["docs_in"] > 66
    assert values["corpus accounted (in = kept + rejected)"] == "yes"
    assert values["corpus near duplicates removed"] != "0" and values["verify"] == "OK"
    assert values["tokenizer"].startswith("cl100k_base (vocab 100277")
    assert {"stdlib tokens", "pages tokens", "stdlib fill ratio", "pages fill ratio"} <= set(values)
    documents = workdir / "corpus" / "documents"
    assert {"code", "web", "stdlib", "pages"} <= {p.name for p in documents.iterdir()}
    assert all(pq.read_table(p).schema.equals(DOCUMENT_SCHEMA) for p in documents.rglob("*.parquet"))
    midtrain = yaml.safe_load((workdir / "midtrain" / "midtrain.yaml").read_text())
    assert midtrain["data"]["shard_sets"] == [{"path": str(workdir / "corpus" / "shards")}], "the stage's shard set is trained on"
    assert "apache_beam" in (workdir / "corpus.log").read_text(), "Beam's logs go to the demo's log file, not the terminal"


@pytest.fixture(scope="module")
def loop(demo) -> LoopRecords:
    return read_records(demo[1] / "loop")


def test_three_policy_versions_go_round_with_every_rollout_decided_once_and_the_sampler_on_the_trainers_exports(loop):
    """The RL loop for real (issue 28 item 3): `midtrain rl` (2 ranks, router replay) -> exports + announces ->
    `rollouts sample` (transformers) hot-swaps -> `rollouts grade` (rule) -> `rollouts etl` -> the trainer, each a
    subprocess of its real CLI on the real broker; no simulator anywhere. What is asserted is read back from the
    topics (read_committed) and from the trainer's export files, not taken from the processes' own counters."""
    records = loop
    announced = {v.policy_version: v for v in records.announced}
    assert sorted(announced) == [0, 1, 2, 3], records.announced  # the starting weights, then one per step
    assert all(v.carries_weights for v in announced.values())

    # At least 3 versions go round: rollouts start at the initial version and at >= 2 later ones.
    starts = Counter(r.policy_version for r in records.rollouts)
    assert 0 in starts and len(set(starts) - {0}) >= 2, starts
    assert max(starts.values()) == 2 * GROUP_SIZE  # max_groups_per_version: 2 groups per version, then the sampler waits
    assert all(r.policy_version <= r.policy_version_end and r.policy_version_end in announced for r in records.rollouts)

    # Nothing lost or doubled: unique rollouts in whole groups; one reward per rollout per grader; the ETL's
    # ledger decides each rollout exactly once (batched, or dropped / dead-lettered with its reason).
    ids = [r.rollout_id for r in records.rollouts]
    assert len(ids) == len(set(ids)) and set(Counter(r.group_id for r in records.rollouts).values()) == {GROUP_SIZE}
    assert Counter((r.rollout_id, r.grader) for r in records.rewards) == Counter((i, GRADER) for i in ids)
    fates = records.fates()
    assert set(fates) == set(ids) and set(fates.values()) == {1}, fates
    batched = {rid for o in records.outcomes if o.kind == "batch" for rid in o.detail["rollout_ids"]}
    assert {r.policy_version for r in records.rollouts if r.rollout_id in batched} >= {0, 1, 2}  # trained on 3 versions
    assert all(o.reason for o in records.outcomes if o.kind != "batch")

    # The trainer learned from the graded rollouts: some passed, some failed, and the last weights differ from the first.
    assert {r.score for r in records.rewards} == {0.0, 1.0}
    weights = [(records.versions_dir / f"version_{v}" / "model.safetensors").read_bytes() for v in (0, 3)]
    assert weights[0] != weights[1]

    # The sampler loaded every version it sampled, each verified against the trainer's announcement and export.
    loaded = dict(records.loaded)
    assert set(starts) <= set(loaded), (starts, records.loaded)
    assert [v for v, _ in records.loaded] == sorted(loaded)  # hot-swapped forwards, each version once
    assert records.sha256_matches(), (records.loaded, records.announced)
    assert all(loaded[v] == announced[v].weights_sha256 for v in loaded)
