"""Packing finished groups into `TrainBatch`es by token budget: pure functions, no I/O.

Groups are the packing unit so a GRPO group reaches the trainer in one step and so all of a group's
batches are committed in one Kafka transaction (crash safety depends on it). Only a group larger
than the budget is split, into consecutive batches built together.

Rollouts that come with a `RolloutRef` (where the ETL read them) make a by-reference batch (claim
check): what the ETL decided plus the references, never a second copy of tokens and routed experts.
`resolve_train_batch` turns it (or a `reference_share` of it) back into the inline form from the
referenced rollouts, checking they are the ones the batch was built from.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np

from ember.rollouts.advantages import token_advantages
from ember.schemas import DecodeError, Rollout, RolloutRef, SourceOffset, TrainBatch, decode


@dataclass(frozen=True)
class ScoredRollout:
    """A rollout that passed every filter, with its sequence-level advantage."""

    rollout: Rollout
    advantage: float
    ref: RolloutRef | None = None  # where the rollout was read: set, the batch goes by reference


def expert_signature(rollout: Rollout) -> tuple | None:
    """Rollouts share a batch only if their routed experts concatenate: same layers, top_k, dtype."""
    experts = rollout.routed_experts
    if experts is None:
        return None
    return (experts.shape[1], experts.shape[2], experts.dtype.str)


def plan_batches(
    sizes: Sequence[int],
    budget: int,
    *,
    min_fill: float = 1.0,
    flush: bool = False,
    keys: Sequence[Hashable] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """First-fit in arrival order: returns (bins of indices to emit now, indices left waiting).

    A bin is emitted when it is filled to at least `min_fill * budget` tokens, or always when `flush`
    (the oldest waiting group hit its deadline). Items larger than the budget get a bin of their own
    and are always emitted (they will be split). Only items with equal `keys` share a bin.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}")
    if not 0.0 < min_fill <= 1.0:
        raise ValueError(f"min_fill must be in (0, 1], got {min_fill}")
    keys = list(keys) if keys is not None else [None] * len(sizes)
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys for {len(sizes)} sizes")
    bins: list[tuple[Hashable, list[int], int]] = []
    for index, size in enumerate(sizes):
        if size <= 0:
            raise ValueError(f"item {index} has {size} tokens; every group has at least one token")
        if size > budget:
            bins.append((keys[index], [index], size))
            continue
        for b, (key, members, used) in enumerate(bins):
            if key == keys[index] and used + size <= budget:
                bins[b] = (key, members + [index], used + size)
                break
        else:
            bins.append((keys[index], [index], size))
    emit: list[list[int]] = []
    waiting: list[int] = []
    for _key, members, used in bins:
        if flush or used >= min_fill * budget:
            emit.append(members)
        else:
            waiting.extend(members)
    return emit, sorted(waiting)


def split_by_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Next-fit over consecutive items (sequences, or whole episodes: `episodes.episode_chunks`), for the one group
    that exceeds the budget."""
    chunks: list[list[int]] = []
    used = budget + 1
    for index, length in enumerate(lengths):
        if length > budget:
            raise ValueError(f"sequence {index} has {length} tokens, over the {budget}-token budget")
        if used + length > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(index)
        used += length
    return chunks


def batch_id_for(rollout_ids: Sequence[str]) -> str:
    """Content-derived id: the same rollouts always get the same id, so a duplicate batch is visible."""
    digest = hashlib.blake2b("\x1f".join(rollout_ids).encode("utf-8"), digest_size=12).hexdigest()
    return f"b-{digest}"


def episode_ids(rollouts: Sequence[Rollout]) -> list[str]:
    """A batch's `episode_ids`: each rollout's episode, or [] when none is a segment (the pre-episode form)."""
    if all(r.episode_id is None for r in rollouts):
        return []
    return [r.episode_key for r in rollouts]


def build_train_batch(
    sequences: Sequence[ScoredRollout],
    *,
    step: int,
    source_offsets: list[SourceOffset],
    created_at_us: int,
    advantage_estimator: str | None = None,
    advantage_estimators: Sequence[str] = (),
) -> TrainBatch:
    """Concatenate sequences into one packed batch with cu_seqlens boundaries, stamped with the
    estimator that computed the advantages: `advantage_estimator` for all, or `advantage_estimators` one per
    sequence (a mixed batch; the batch-level one is then theirs when they agree, else None)."""
    if not sequences:
        raise ValueError("a batch needs at least one sequence")
    rollouts = [s.rollout for s in sequences]
    signatures = {expert_signature(r) for r in rollouts}
    if len(signatures) != 1:
        raise ValueError(f"rollouts with different routed-expert layouts {signatures} cannot share a batch")
    lengths = np.array([r.num_tokens for r in rollouts], dtype=np.int64)
    cu_seqlens = np.zeros(len(rollouts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    ids = [r.rollout_id for r in rollouts]
    refs = [s.ref for s in sequences]
    estimators = list(advantage_estimators)
    if estimators:
        if len(estimators) != len(sequences):
            raise ValueError(f"{len(estimators)} estimators for {len(sequences)} sequences")
        advantage_estimator = estimators[0] if len(set(estimators)) == 1 else None
    common = dict(
        batch_id=batch_id_for(ids),
        step=step,
        cu_seqlens=cu_seqlens,
        policy_versions=np.array([r.policy_version for r in rollouts], dtype=np.int64),
        rollout_ids=ids,
        source_offsets=source_offsets,
        created_at_us=created_at_us,
        advantage_estimator=advantage_estimator,
        episode_ids=episode_ids(rollouts),
        advantage_estimators=estimators,
    )
    if all(ref is not None for ref in refs):
        return TrainBatch(
            tokens=None,
            loss_mask=None,
            advantages=None,
            sampler_logprobs=None,
            rollout_refs=refs,
            sequence_advantages=np.array([s.advantage for s in sequences], dtype=np.float32),
            **common,
        )
    experts = None
    if signatures != {None}:
        experts = np.concatenate([r.routed_experts for r in rollouts])
    return TrainBatch(
        tokens=np.concatenate([r.tokens for r in rollouts]),
        loss_mask=np.concatenate([r.loss_mask for r in rollouts]),
        advantages=np.concatenate([token_advantages(s.advantage, s.rollout.loss_mask) for s in sequences]),
        sampler_logprobs=np.concatenate([r.sampler_logprobs for r in rollouts]),
        routed_experts=experts,
        **common,
    )


def reference_share(batch: TrainBatch, first: int, last: int) -> TrainBatch:
    """Rollouts [first, last) of a by-reference batch, as a by-reference batch of their own (cu_seqlens rebased)."""
    if not batch.by_reference:
        raise ValueError(f"batch {batch.batch_id} is inline, not by reference")
    if not 0 <= first < last <= batch.num_sequences:
        raise ValueError(f"rollouts [{first}, {last}) outside batch {batch.batch_id} of {batch.num_sequences}")
    cu = batch.cu_seqlens
    return TrainBatch(
        batch_id=batch.batch_id,
        step=batch.step,
        tokens=None,
        loss_mask=None,
        advantages=None,
        sampler_logprobs=None,
        cu_seqlens=(cu[first : last + 1] - cu[first]).astype(np.int32),
        policy_versions=batch.policy_versions[first:last],
        rollout_ids=batch.rollout_ids[first:last],
        source_offsets=batch.source_offsets,
        created_at_us=batch.created_at_us,
        advantage_estimator=batch.advantage_estimator,
        rollout_refs=batch.rollout_refs[first:last],
        sequence_advantages=batch.sequence_advantages[first:last],
        episode_ids=batch.episode_ids[first:last],
        advantage_estimators=batch.advantage_estimators[first:last],
    )


class MissingRollout(DecodeError):
    """A batch references a rollout that is not there any more, or not the bytes the ETL decided on."""


def referenced_rollout(ref: RolloutRef, value: bytes | None) -> Rollout:
    """The rollout in the message a reference names; MissingRollout unless its bytes hash to the reference.

    Decoded without the schema checks: the sha256 proves these are the very bytes the ETL validated."""
    if value is None:
        raise MissingRollout(f"rollout {ref} is not in the log")
    if hashlib.sha256(value).digest() != ref.sha256:
        raise MissingRollout(
            f"rollout {ref}: the message there is not the one the batch was built from (sha256 differs; "
            "was the rollouts topic deleted and recreated?)"
        )
    try:
        record = decode(value, validate=False)
    except DecodeError as exc:  # bytes the ETL never admitted: an older ETL's batch, or a forged one
        raise DecodeError(f"rollout {ref}: {exc}") from None
    if not isinstance(record, Rollout):
        raise MissingRollout(f"rollout {ref}: the message is a {type(record).__name__}, not a Rollout")
    return record


def resolve_from_log(batch: TrainBatch, values: Mapping[tuple[str, int, int], bytes]) -> TrainBatch:
    """A by-reference batch resolved from messages already in memory, keyed (topic, partition, offset)."""
    if not batch.by_reference:
        return batch
    rollouts = [referenced_rollout(r, values.get((r.topic, r.partition, r.offset))) for r in batch.rollout_refs]
    return resolve_train_batch(batch, rollouts)


def resolve_train_batch(batch: TrainBatch, rollouts: Sequence[Rollout]) -> TrainBatch:
    """The inline batch a by-reference batch stands for, from its rollouts in reference order.

    Raises DecodeError naming the reference when a rollout is not the one the batch was built from
    (id, length or policy version differ); the bytes themselves are checked by sha256 where they are read."""
    if len(rollouts) != batch.num_sequences:
        raise DecodeError(f"batch {batch.batch_id}: {len(rollouts)} rollouts for {batch.num_sequences} references")
    lengths = np.diff(batch.cu_seqlens)
    for i, (ref, rollout) in enumerate(zip(batch.rollout_refs, rollouts)):
        expected = (batch.rollout_ids[i], int(lengths[i]), int(batch.policy_versions[i]))
        found = (rollout.rollout_id, rollout.num_tokens, int(rollout.policy_version))
        if found != expected:
            raise DecodeError(
                f"batch {batch.batch_id}: {ref} holds rollout (id, tokens, policy version) {found}, the batch expects {expected}"
            )
    signatures = {expert_signature(r) for r in rollouts}
    if len(signatures) != 1:
        raise DecodeError(f"batch {batch.batch_id}: referenced rollouts have different routed-expert layouts {signatures}")
    return TrainBatch(
        batch_id=batch.batch_id,
        step=batch.step,
        tokens=np.concatenate([r.tokens for r in rollouts]),
        loss_mask=np.concatenate([r.loss_mask for r in rollouts]),
        advantages=np.concatenate(
            [token_advantages(float(a), r.loss_mask) for a, r in zip(batch.sequence_advantages, rollouts)]
        ),
        sampler_logprobs=np.concatenate([r.sampler_logprobs for r in rollouts]),
        cu_seqlens=batch.cu_seqlens,
        policy_versions=batch.policy_versions,
        rollout_ids=list(batch.rollout_ids),
        source_offsets=batch.source_offsets,
        routed_experts=None if signatures == {None} else np.concatenate([r.routed_experts for r in rollouts]),
        created_at_us=batch.created_at_us,
        advantage_estimator=batch.advantage_estimator,
        episode_ids=list(batch.episode_ids),
        advantage_estimators=list(batch.advantage_estimators),
    )


def position_ids(cu_seqlens: np.ndarray) -> np.ndarray:
    """Positions restart at 0 for every packed sequence (what reset_position_ids does in Megatron)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = int(cu[-1])
    starts = np.repeat(cu[:-1], np.diff(cu))
    return np.arange(total, dtype=np.int64) - starts
