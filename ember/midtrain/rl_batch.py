"""`RLBatch`: one train batch as the RL trainer consumes it, typed tensors instead of a name-keyed dict.

The trainer never sees the transport: whatever delivers batches (the Kafka reader in `midtrain rl`,
a list in the tests and benchmarks) turns each schema `TrainBatch` into an `RLBatch` with `rl_batch`.
`packed_seq_params` describes its packed row to Transformer Engine's THD attention, `attention_inputs`
picks that or the dense mask for the attention a model was built with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from ember.midtrain.rl_math import block_diagonal_causal_mask
from ember.rollouts.batching import position_ids
from ember.schemas import TrainBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

    from ember.midtrain.model import PackedAttention


@dataclass(frozen=True)
class RLBatch:
    """Tensors in training dtypes (one packed stream of T tokens, S sequences) and the ids the loop logs."""

    batch_id: str
    step: int  # the ETL's batch step
    rollout_ids: tuple[str, ...]
    tokens: Tensor  # [T] int64
    loss_mask: Tensor  # [T] float32, 1 on policy tokens
    advantages: Tensor  # [T] float32
    sampler_logprobs: Tensor  # [T] float32
    cu_seqlens: Tensor  # [S + 1] int32
    position_ids: Tensor  # [T] int64, restarting at 0 in every sequence
    policy_versions: Tensor  # [S] int64
    routed_experts: Tensor | None  # [T, layers, top_k] uint8 (int32 for wider ids), or None
    advantage_estimator: str | None = None  # what computed `advantages`, as the ETL stamped it; None: not stated
    offset: int | None = None  # where the transport read it, for the metrics line
    # The transport's position once this batch is trained: checkpoints store it so a resume reads the next one.
    position: dict[str, Any] | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.rollout_ids)

    def to(self, device: torch.device | str) -> RLBatch:
        tensors = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **tensors)

    def without_routed_experts(self) -> RLBatch:
        return dataclasses.replace(self, routed_experts=None)


def rl_batch(batch: TrainBatch, *, offset: int | None = None, position: dict[str, Any] | None = None) -> RLBatch:
    """The trainer's view of a schema batch (uint16 expert ids widen to int32, which torch indexes with)."""
    experts = batch.routed_experts
    if experts is not None:
        experts = torch.from_numpy(np.array(experts, dtype=np.uint8 if experts.dtype == np.uint8 else np.int32))
    return RLBatch(
        batch_id=batch.batch_id,
        step=batch.step,
        rollout_ids=tuple(batch.rollout_ids),
        tokens=torch.from_numpy(batch.tokens.astype(np.int64)),
        loss_mask=torch.from_numpy(batch.loss_mask.astype(np.float32)),
        advantages=torch.from_numpy(np.array(batch.advantages, dtype=np.float32)),
        sampler_logprobs=torch.from_numpy(np.array(batch.sampler_logprobs, dtype=np.float32)),
        cu_seqlens=torch.from_numpy(np.array(batch.cu_seqlens, dtype=np.int32)),
        position_ids=torch.from_numpy(position_ids(batch.cu_seqlens)),
        policy_versions=torch.from_numpy(np.array(batch.policy_versions, dtype=np.int64)),
        routed_experts=experts,
        advantage_estimator=batch.advantage_estimator,
        offset=offset,
        position=position,
    )


def packed_seq_params(cu_seqlens: Tensor) -> PackedSeqParams:
    """THD parameters of one packed row: every sequence its own attention block (cu_seqlens for queries
    and keys alike, int32 as the attention kernels take them), max_seqlen its longest sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def attention_inputs(attention: PackedAttention, cu_seqlens: Tensor) -> tuple[Tensor | None, PackedSeqParams | None]:
    """(attention_mask, packed_seq_params) that keep a packed row's sequences apart under `attention`
    (`model.packed_attention` of the built model): exactly one of the two, the one it honours."""
    if attention == "thd":
        return None, packed_seq_params(cu_seqlens)
    if attention == "dense_mask":
        return block_diagonal_causal_mask(cu_seqlens), None
    raise ValueError(f"attention must be 'thd' or 'dense_mask', got {attention!r}")
