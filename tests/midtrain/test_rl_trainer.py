"""The RL trainer's input without a broker: `RLBatch` from schema batches. (`run_rl` on in-memory batches runs
under torchrun in test_rl_ranks.py; replay/off, checkpoints and TensorBoard against the broker in test_rl.py.)
"""

from __future__ import annotations

import numpy as np
import torch

from ember.midtrain.rl.batch import rl_batch
from ember.schemas import TrainBatch


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

