"""The RL trainer without a broker: `RLBatch` from schema batches, and `run_rl` on in-memory batches.

Megatron-core keeps global parallel state, so every trainer runs in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ember.midtrain.rl_batch import rl_batch
from ember.schemas import TrainBatch

from .rl_support import rl_config

REPO = Path(__file__).resolve().parents[2]
GROUPS = 3


def _schema_batch(experts_dtype: type) -> TrainBatch:
    return TrainBatch(
        batch_id="b", step=4, tokens=np.arange(7, dtype=np.uint32), loss_mask=np.array([0, 1, 1, 0, 0, 1, 1], np.uint8),
        advantages=np.full(7, 0.5, np.float32), sampler_logprobs=np.full(7, -1.0, np.float32),
        cu_seqlens=np.array([0, 3, 7], np.int32), policy_versions=np.array([2, 3], np.int64), rollout_ids=["r0", "r1"],
        routed_experts=np.arange(7 * 2 * 2).reshape(7, 2, 2).astype(experts_dtype),
    ).validate()


def test_rl_batch_has_training_dtypes_and_positions_per_sequence():
    b = rl_batch(_schema_batch(np.uint8), offset=9, position={"topic": "t", "offsets": {"0": 10}})
    assert b.tokens.dtype == torch.int64 and b.loss_mask.dtype == torch.float32
    assert b.advantages.dtype == b.sampler_logprobs.dtype == torch.float32
    assert b.cu_seqlens.dtype == torch.int32 and b.policy_versions.dtype == torch.int64
    assert b.routed_experts.dtype == torch.uint8 and b.routed_experts.shape[0] == b.tokens.shape[0]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert (b.batch_id, b.step, b.num_sequences, b.offset) == ("b", 4, 2, 9)
    assert b.position == {"topic": "t", "offsets": {"0": 10}}
    assert rl_batch(_schema_batch(np.uint16)).routed_experts.dtype == torch.int32, "torch indexes with int32"
    assert b.without_routed_experts().routed_experts is None


def _support(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.midtrain.rl_support", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]


def test_run_rl_on_in_memory_batches_replays_routing_publishes_and_checkpoints(tmp_path):
    policy = rl_config(tmp_path / "policy.yaml", tmp_path / "policy", "unused")
    batch_dir = tmp_path / "batches"
    batch_dir.mkdir()
    _finish(_support("sample", str(policy), str(GROUPS), str(batch_dir)))
    runs = {}
    for mode in ("replay", "off"):
        config = rl_config(tmp_path / f"{mode}.yaml", tmp_path / mode, "unused", replay=mode, steps=GROUPS, correction="mis")
        data = yaml.safe_load(config.read_text())
        data["init_checkpoint"] = str(tmp_path / "policy" / "checkpoints" / "step_00000000")
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        runs[mode] = _support("memory", str(config), str(batch_dir), str(tmp_path / f"{mode}.json"))
    for proc in runs.values():
        _finish(proc)
    found = {mode: json.loads((tmp_path / f"{mode}.json").read_text()) for mode in runs}
    records = {mode: [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()] for mode in runs}
    replay, off = records["replay"], records["off"]
    assert [r["batch_id"] for r in replay] == [r["batch_id"] for r in off] == found["replay"]["batch_ids"]
    assert found["replay"]["published"] == found["off"]["published"] == [0, 1, 2, 3], "the start, then every checkpoint"
    assert found["replay"]["steps"] == GROUPS
    for r in replay:
        assert r["replayed"] and r["routing_disagreement_per_layer"] == [0.0, 0.0] and r["offset"] is None
    for r in off:
        assert not r["replayed"] and r["routing_disagreement"] > 0
    # same weights, same first batch: forcing the sampler's experts removes most of the log-prob gap
    assert off[0]["mismatch"]["mean_abs_delta_logp"] > replay[0]["mismatch"]["mean_abs_delta_logp"] > 0
    assert (tmp_path / "replay" / "checkpoints" / "latest").read_text() == f"step_{GROUPS:08d}"
    assert (tmp_path / "replay" / "COMPLETE").read_text() == f"{GROUPS}\n"
    # TensorBoard events beside metrics.jsonl carry the mismatch metrics at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "off"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"mismatch/{key}" for key in off[0]["mismatch"]} | {"loss", "clip_frac", "routing_disagreement"} <= tags
    assert "routing_disagreement_per_layer/1" in tags and not any(t.startswith(("batch_id", "replayed")) for t in tags)
    kl = events.Scalars("mismatch/kl_mu_pi")
    assert [e.step for e in kl] == [r["step"] for r in off]
    assert [e.value for e in kl] == pytest.approx([r["mismatch"]["kl_mu_pi"] for r in off], rel=1e-6)
