"""The RL loop for real (issue 28 item 3): `midtrain rl` (2 ranks, router replay) -> exports + announces ->
`rollouts sample` (transformers) hot-swaps -> `rollouts grade` (rule) -> `rollouts etl` -> the trainer, each a
subprocess of its real CLI on the real broker; no simulator anywhere. What is asserted is read back from the
topics (read_committed) and from the trainer's export files, not taken from the processes' own counters."""

from __future__ import annotations

from collections import Counter

import pytest

from ember.demo.loop_stage import GRADER, GROUP_SIZE, run_loop
from tests.tokenize.support import train_tokenizer

pytestmark = pytest.mark.integration


def test_three_policy_versions_go_round_with_every_rollout_decided_once_and_the_sampler_on_the_trainers_exports(
    kafka, topic_prefix, tmp_path
):
    records = run_loop(tmp_path, topic_prefix, train_tokenizer(tmp_path / "tokenizer.json", vocab_size=512), steps=3)
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
