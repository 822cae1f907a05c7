"""`RLBatch`: one train batch as the RL trainer consumes it, typed tensors instead of a name-keyed dict.

The trainer never sees the transport: whatever delivers batches (the Kafka reader in `midtrain rl`,
a list in the tests and benchmarks) turns each schema `TrainBatch` into an `RLBatch` with `rl_batch`.

With several data-parallel ranks each rank trains a contiguous share of a batch's rollouts:
`share_bounds` cuts the batch where its token count is closest to an equal split, from `cu_seqlens`
alone (between episodes only, `episode_share_bounds`, when the batch holds segments), and `rl_batch_share` decodes only that share of an encoded message (the codec's arrays are
zero-copy views, so the other ranks' tokens and routed experts are never copied or checked here). A
by-reference batch (what the ETL writes) carries no tokens at all: each rank fetches only its share's
rollouts (`fetch`, a `RolloutFetcher.rollouts` in `midtrain rl`), never the others'.
`packed_seq_params` describes its packed row to Transformer Engine's THD attention, `attention_inputs`
picks that or the dense mask for the attention a model was built with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ember.midtrain.rl.step_math import block_diagonal_causal_mask
from ember.rollouts.batching import position_ids, reference_share, resolve_train_batch
from ember.schemas import DecodeError, Rollout, RolloutRef, TrainBatch
from ember.schemas.codec import decode

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
    # [S] int64 numbering each sequence's episode from 0 (an episode's segments share a number and are
    # consecutive), so the loss normalises them together; None: every sequence is an episode of its own.
    episodes: Tensor | None = None
    advantage_estimator: str | None = None  # what computed `advantages`, as the ETL stamped it; None: not stated
    # [S] what computed each sequence's advantage (a batch may mix group and product estimators); None: not stated.
    advantage_estimators: tuple[str | None, ...] = ()
    offset: int | None = None  # where the transport read it, for the metrics line
    # The transport's position once this batch is trained: checkpoints store it so a resume reads the next one.
    position: dict[str, Any] | None = None
    # Bytes of per-token arrays this rank decoded (its share only), and of those the routed experts.
    decoded_bytes: int = 0
    routed_expert_bytes: int = 0

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


_TOKEN_ARRAYS = ("tokens", "loss_mask", "advantages", "sampler_logprobs")


def share_bounds(cu_seqlens: np.ndarray, ranks: int) -> np.ndarray:
    """[ranks + 1] sequence indices: rank r trains sequences [b[r], b[r + 1]). Contiguous, at least one
    sequence each, every cut at the sequence boundary nearest r / ranks of the batch's tokens, so the
    split is a function of the header alone and every rank computes the same one."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    sequences, total = len(cu) - 1, int(cu[-1])
    if sequences < ranks:
        raise ValueError(
            f"the batch has {sequences} rollouts for {ranks} data-parallel ranks: each rank trains at least one; "
            "give the ETL a larger batches.token_budget or run fewer ranks"
        )
    bounds = [0]
    for r in range(1, ranks):
        target = total * r / ranks
        cut = int(np.searchsorted(cu, target))
        if cut > 0 and (cut > sequences or target - cu[cut - 1] <= cu[cut] - target):
            cut -= 1
        bounds.append(min(max(cut, bounds[-1] + 1), sequences - (ranks - r)))
    bounds.append(sequences)
    return np.array(bounds, dtype=np.int64)


def episode_share_bounds(cu_seqlens: np.ndarray, episode_ids: Sequence[str], ranks: int) -> np.ndarray:
    """`share_bounds` cutting between episodes only: an episode's segments are normalised together
    (seq_mean), so its terms are additive only whole, on one rank."""
    if not episode_ids:
        return share_bounds(cu_seqlens, ranks)
    starts = [i for i, e in enumerate(episode_ids) if i == 0 or e != episode_ids[i - 1]] + [len(episode_ids)]
    cuts = np.asarray(starts, dtype=np.int64)
    try:
        bounds = share_bounds(np.asarray(cu_seqlens, dtype=np.int64)[cuts], ranks)
    except ValueError:
        raise ValueError(f"the batch has {len(starts) - 1} episodes for {ranks} data-parallel ranks: each rank trains at least one") from None
    return cuts[bounds]


def _header_problems(batch: TrainBatch) -> list[str]:
    """What a share cannot check about the whole batch: array lengths, cu_seqlens, unique rollout ids
    (sizes and the small per-sequence arrays only; no per-token contents are read)."""
    if batch.by_reference:
        n, cu = batch.num_tokens, batch.cu_seqlens
        problems = [] if len(batch.rollout_refs) == batch.num_sequences else [f"{len(batch.rollout_refs)} rollout references for {batch.num_sequences} rollout ids"]
    else:
        n, cu = len(batch.tokens), batch.cu_seqlens
        problems = [f"{name} has {len(getattr(batch, name))} entries for {n} tokens" for name in _TOKEN_ARRAYS[1:] if len(getattr(batch, name)) != n]
    if batch.routed_experts is not None and (batch.routed_experts.ndim != 3 or len(batch.routed_experts) != n):
        problems.append(f"routed_experts shape {batch.routed_experts.shape} must be [{n}, layers, top_k]")
    if len(cu) != batch.num_sequences + 1 or len(batch.policy_versions) != batch.num_sequences:
        problems.append(f"cu_seqlens ({len(cu)}) and policy_versions ({len(batch.policy_versions)}) do not match {batch.num_sequences} rollout ids")
    elif cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
        problems.append(f"cu_seqlens must rise strictly from 0 to {n}")
    if len(set(batch.rollout_ids)) != batch.num_sequences:
        problems.append("a rollout appears twice in one batch")
    if batch.episode_ids and len(batch.episode_ids) != batch.num_sequences:
        problems.append(f"{len(batch.episode_ids)} episode ids for {batch.num_sequences} rollout ids")
    return problems


RolloutSource = Callable[[Sequence[RolloutRef]], list[Rollout]]


def rl_batch_share(
    message: bytes | bytearray | memoryview, rank: int, ranks: int, *, offset: int | None = None,
    position: dict[str, Any] | None = None, fetch: RolloutSource | None = None,
) -> RLBatch:
    """This rank's share (`share_bounds`) of an encoded TrainBatch, decoded and validated alone; for a
    by-reference batch, `fetch` reads this share's rollouts only.

    Raises DecodeError naming the batch when the message is not a well-formed TrainBatch or the share is invalid."""
    batch = decode(message, validate=False)  # structure only; arrays stay views of the message
    if not isinstance(batch, TrainBatch):
        raise DecodeError(f"expected a TrainBatch message, got a {type(batch).__name__}")
    problems = _header_problems(batch)
    if problems:
        raise DecodeError(f"invalid TrainBatch {batch.batch_id}: " + "; ".join(problems))
    bounds = episode_share_bounds(batch.cu_seqlens, batch.episode_ids, ranks)
    first, last = int(bounds[rank]), int(bounds[rank + 1])
    if batch.by_reference:
        return rl_batch(_resolved_share(batch, first, last, fetch), offset=offset, position=position)
    start, end = int(batch.cu_seqlens[first]), int(batch.cu_seqlens[last])
    share = TrainBatch(
        batch_id=batch.batch_id,
        step=batch.step,
        **{name: getattr(batch, name)[start:end] for name in _TOKEN_ARRAYS},
        cu_seqlens=(batch.cu_seqlens[first : last + 1] - start).astype(np.int32),
        policy_versions=batch.policy_versions[first:last],
        rollout_ids=batch.rollout_ids[first:last],
        source_offsets=batch.source_offsets,
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[start:end],
        created_at_us=batch.created_at_us,
        advantage_estimator=batch.advantage_estimator,
        episode_ids=batch.episode_ids[first:last],
        advantage_estimators=batch.advantage_estimators[first:last],
    )
    try:
        share.validate()
    except ValueError as exc:
        raise DecodeError(f"rollouts {first}..{last - 1} of batch {batch.batch_id}: {exc}") from None
    return rl_batch(share, offset=offset, position=position)


def _resolved_share(batch: TrainBatch, first: int, last: int, fetch: RolloutSource | None) -> TrainBatch:
    if fetch is None:
        raise DecodeError(f"batch {batch.batch_id} is by reference: this trainer has no rollout source to fetch its rollouts")
    share = reference_share(batch, first, last)
    try:
        share.validate()
    except ValueError as exc:
        raise DecodeError(f"rollouts {first}..{last - 1} of batch {batch.batch_id}: {exc}") from None
    return resolve_train_batch(share, fetch(share.rollout_refs))


def episode_numbers(episode_ids: Sequence[str]) -> Tensor | None:
    """[S] episode numbers from a batch's `episode_ids` (consecutive ids alike share one), or None when it has none."""
    if not episode_ids:
        return None
    starts = [i == 0 or e != episode_ids[i - 1] for i, e in enumerate(episode_ids)]
    return torch.tensor(np.cumsum(starts) - 1, dtype=torch.int64)


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
        episodes=episode_numbers(batch.episode_ids),
        advantage_estimator=batch.advantage_estimator,
        advantage_estimators=tuple(batch.sequence_estimators),
        offset=offset,
        position=position,
        decoded_bytes=sum(getattr(batch, name).nbytes for name in _TOKEN_ARRAYS) + (0 if experts is None else batch.routed_experts.nbytes),
        routed_expert_bytes=0 if experts is None else batch.routed_experts.nbytes,
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
