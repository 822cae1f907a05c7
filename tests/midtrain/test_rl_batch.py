"""A batch mixing simulated groups' advantages with product singles' carries each sequence's estimator through
the wire codec and into every rank's share, inline and by reference; batches written before the column read as
the batch's one estimator throughout."""

from __future__ import annotations

import hashlib

import pytest

from ember.midtrain.rl.batch import rl_batch, rl_batch_share
from ember.rollouts.batching import ScoredRollout, build_train_batch
from ember.schemas import RolloutRef, TrainBatch, decode_train_batch, encode, encode_train_batch
from tests.rollouts.helpers import rollout

# Two GRPO groups' samples, then two product completions scored against the EMA baseline, then one against LOO.
ESTIMATORS = ["grpo", "grpo", "grpo", "product_ema", "product_ema", "product_loo"]


def _mixed(by_reference: bool) -> tuple[TrainBatch, list]:
    rollouts = [rollout(f"g{i // 3}" if e == "grpo" else f"c{i}", i % 3, tokens=12 + 3 * i) for i, e in enumerate(ESTIMATORS)]
    refs = [RolloutRef("p.rollouts", 0, i, hashlib.sha256(encode(r)).digest()) if by_reference else None for i, r in enumerate(rollouts)]
    scored = [ScoredRollout(r, 0.25 * i - 0.5, ref) for i, (r, ref) in enumerate(zip(rollouts, refs))]
    batch = build_train_batch(scored, step=3, source_offsets=[], created_at_us=1, advantage_estimators=ESTIMATORS)
    return batch.validate(), rollouts


@pytest.mark.parametrize("by_reference", [False, True], ids=["inline", "by_reference"])
def test_a_mixed_batch_carries_each_sequences_estimator_to_every_rank(by_reference):
    batch, rollouts = _mixed(by_reference)
    assert batch.advantage_estimator is None, "no one estimator speaks for a mixed batch"
    decoded = decode_train_batch(encode_train_batch(batch))
    assert decoded.advantage_estimators == ESTIMATORS and decoded.sequence_estimators == ESTIMATORS

    def fetch(refs):
        return [rollouts[ref.offset] for ref in refs]  # the rollouts topic, read at each reference's offset

    message = encode_train_batch(batch)
    for ranks in (1, 2, 3):
        shares = [rl_batch_share(message, rank, ranks, fetch=fetch if by_reference else None) for rank in range(ranks)]
        assert sum((s.advantage_estimators for s in shares), ()) == tuple(ESTIMATORS)
        assert all(len(s.advantage_estimators) == s.num_sequences for s in shares)
    whole = rl_batch_share(message, 0, 1, fetch=fetch if by_reference else None)
    # each sequence's advantage is the one scored for it, next to its estimator
    cu = whole.cu_seqlens.tolist()
    firsts = [float(whole.advantages[cu[i] + 4]) for i in range(len(ESTIMATORS))]  # past the 4 prompt tokens
    assert firsts == pytest.approx([0.25 * i - 0.5 for i in range(len(ESTIMATORS))])


def test_a_batch_without_the_column_reads_as_its_one_estimator():
    batch, _ = _mixed(False)
    older = TrainBatch(**{**vars(batch), "advantage_estimator": "grpo", "advantage_estimators": []}).validate()
    decoded = decode_train_batch(encode_train_batch(older))
    assert decoded.advantage_estimators == [] and decoded.sequence_estimators == ["grpo"] * len(ESTIMATORS)
    assert rl_batch(decoded).advantage_estimators == ("grpo",) * len(ESTIMATORS)


def test_estimators_that_do_not_match_the_sequences_are_refused():
    batch, _ = _mixed(False)
    with pytest.raises(ValueError, match="'advantage_estimators': 2 estimators for 6 sequences"):
        TrainBatch(**{**vars(batch), "advantage_estimators": ESTIMATORS[:2]}).validate()
