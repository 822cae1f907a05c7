"""RL beyond one rank: each rank decodes only its share of a batch, and the step on 2 ranks (data- or
expert-parallel, gloo on CPU) is the step one rank takes on the same batches.

Megatron-core keeps global parallel state, so every trainer runs in a subprocess (torchrun for 2 ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ember.midtrain.rl.batch import rl_batch_share, share_bounds
from ember.schemas import DecodeError, TrainBatch, decode_train_batch, encode_train_batch

from .rl_support import rl_config

# Several megatron processes (3 runs of 1-2 ranks): more than the default timeout on a busy machine.
pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[2]
GROUPS = 3
TOKEN_ARRAYS = ("tokens", "loss_mask", "advantages", "sampler_logprobs", "routed_experts")


def _batch(lengths: list[int]) -> TrainBatch:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    return TrainBatch(
        batch_id="b7", step=7, tokens=np.arange(n, dtype=np.uint32), loss_mask=np.ones(n, np.uint8),
        advantages=np.linspace(-1, 1, n, dtype=np.float32), sampler_logprobs=np.full(n, -0.5, np.float32),
        cu_seqlens=cu, policy_versions=np.arange(len(lengths), dtype=np.int64),
        rollout_ids=[f"r{i}" for i in range(len(lengths))],
        routed_experts=(np.arange(n * 2 * 2).reshape(n, 2, 2) % 251).astype(np.uint8),
    ).validate()


def test_shares_are_contiguous_token_balanced_and_decode_only_their_rows():
    lengths = [5, 30, 7, 9, 12, 3, 20, 6]
    batch = _batch(lengths)
    message = encode_train_batch(batch)
    for ranks in (1, 2, 3, 8):
        bounds = share_bounds(batch.cu_seqlens, ranks)
        assert bounds[0] == 0 and bounds[-1] == len(lengths) and np.all(np.diff(bounds) >= 1)
        shares = [rl_batch_share(message, r, ranks, offset=4) for r in range(ranks)]
        # together the shares are the batch, in order, each rank's arrays its own rows only
        assert sum((s.rollout_ids for s in shares), ()) == tuple(batch.rollout_ids)
        assert np.concatenate([s.tokens.numpy() for s in shares]).tolist() == batch.tokens.tolist()
        assert np.concatenate([s.routed_experts.numpy() for s in shares]).tolist() == batch.routed_experts.tolist()
        assert all(s.cu_seqlens[0] == 0 and s.position_ids[0] == 0 and s.offset == 4 for s in shares)
        full = sum(getattr(batch, name).nbytes for name in TOKEN_ARRAYS)
        assert sum(s.decoded_bytes for s in shares) == full
        assert sum(s.routed_expert_bytes for s in shares) == batch.routed_experts.nbytes
        assert shares[0].decoded_bytes == sum(getattr(batch, n)[: int(batch.cu_seqlens[bounds[1]])].nbytes for n in TOKEN_ARRAYS)
    # 92 tokens over 2 ranks: the cut nearest 46 is after 3 rollouts (42 tokens), not after 4 (51)
    assert share_bounds(batch.cu_seqlens, 2).tolist() == [0, 3, 8]
    assert share_bounds(batch.cu_seqlens, 3).tolist() == [0, 2, 5, 8]
    with pytest.raises(ValueError, match="8 rollouts for 9 data-parallel ranks"):
        share_bounds(batch.cu_seqlens, 9)


def test_a_share_is_validated_alone_and_errors_name_batch_and_rollouts():
    batch = _batch([4, 4, 4, 4])
    batch.sampler_logprobs[13] = np.nan  # in the second rank's share
    message = encode_train_batch(batch)
    assert rl_batch_share(message, 0, 2).rollout_ids == ("r0", "r1"), "rank 0 never reads the bad token"
    with pytest.raises(DecodeError, match=r"rollouts 2\.\.3 of batch b7: .*'sampler_logprobs': must be finite"):
        rl_batch_share(message, 1, 2)
    short = _batch([4, 4])
    short.cu_seqlens[1] = 9
    with pytest.raises(DecodeError, match="invalid TrainBatch b7: cu_seqlens must rise strictly from 0 to 8"):
        rl_batch_share(encode_train_batch(short), 0, 2)


def _support(ranks: int, log: Path, *args: str) -> subprocess.Popen:
    """`rl_support` on one rank, or under torchrun on `ranks`, its output to `log`."""
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, *launcher, "-m", "tests.midtrain.rl_support", *args],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )


@pytest.fixture(scope="module")
def ranked_runs(tmp_path_factory, sampled_policy) -> tuple[Path, dict[str, list[dict]]]:
    """The same sampled batches from the same weights on 1 rank, 2 data-parallel ranks, 2 expert-parallel ranks
    (the three runs side by side: each is a separate job with its own run directory)."""
    root = tmp_path_factory.mktemp("rl-ranks")
    batch_dir = sampled_policy.copy_batches(GROUPS, root / "batches")
    layouts = {"one": (1, {}), "dp2": (2, {}), "ep2": (2, {"expert": 2})}
    runs = {}
    try:
        for name, (ranks, parallel) in layouts.items():
            config = rl_config(root / f"{name}.yaml", root / name, "unused", steps=GROUPS, correction="tis")
            data = yaml.safe_load(config.read_text())
            data.update(init_checkpoint=str(sampled_policy.init_checkpoint), parallel=parallel)
            config.write_text(yaml.safe_dump(data, sort_keys=False))
            runs[name] = _support(ranks, root / f"{name}.log", "memory", str(config), str(batch_dir), str(root / f"{name}.json"))
        for name, run in runs.items():
            assert run.wait(timeout=400) == 0, (root / f"{name}.log").read_text()[-8000:]
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
    records = {}
    for name in layouts:
        assert json.loads((root / f"{name}.json").read_text())["published"] == [0, 1, 2, 3], "the start, then every checkpoint"
        records[name] = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return batch_dir, records


@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_two_ranks_take_the_single_rank_step_on_the_same_batches(ranked_runs, layout):
    """Global token-mean: each step's loss (and, after the updates, the next step's) is the single rank's to 1e-5."""
    _batch_dir, records = ranked_runs
    one, two = records["one"], records[layout]
    assert [r["batch_id"] for r in two] == [r["batch_id"] for r in one] and len(one) == GROUPS
    for a, b in zip(one, two):
        assert b["ranks"] == 2 and a["ranks"] == 1
        assert (b["sequences"], b["tokens"], b["policy_tokens"]) == (a["sequences"], a["tokens"], a["policy_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["mismatch"]["mean_abs_delta_logp"] == pytest.approx(a["mismatch"]["mean_abs_delta_logp"], abs=1e-5)
        assert b["mismatch"]["max_abs_delta_logp"] == pytest.approx(a["mismatch"]["max_abs_delta_logp"], abs=1e-5)
        assert b["correction_mean_weight"] == pytest.approx(a["correction_mean_weight"], abs=1e-5)
        assert b["replayed"] and b["routing_disagreement_per_layer"] == [0.0, 0.0], "replay forces every rank's tokens"


def test_each_rank_decodes_only_its_share_of_each_batch(ranked_runs):
    batch_dir, records = ranked_runs
    batches = {b.batch_id: b for b in (decode_train_batch(p.read_bytes()) for p in sorted(batch_dir.glob("*.batch")))}
    for record in records["dp2"] + records["ep2"]:
        batch = batches[record["batch_id"]]
        full = sum(getattr(batch, name).nbytes for name in TOKEN_ARRAYS)
        assert record["rank_sequences"] == [2, 2]
        assert sum(record["rank_decoded_bytes"]) == full and max(record["rank_decoded_bytes"]) < full
        assert sum(record["rank_routed_expert_bytes"]) == batch.routed_experts.nbytes
        assert max(record["rank_routed_expert_bytes"]) <= batch.routed_experts.nbytes // 2 + 1
    assert all(r["rank_decoded_bytes"] == [r["rank_decoded_bytes"][0]] for r in records["one"])
