"""By-reference (claim-check) train batches: what the ETL writes instead of a second copy of the rollouts,
how the trainer side resolves it, and the errors when a referenced rollout is gone or not the same bytes."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
from kafka import KafkaProducer, TopicPartition

from ember.midtrain.rl.batch import rl_batch_share, share_bounds
from ember.rollouts.admin import _admin, ensure_topics
from ember.rollouts.batching import (
    MissingRollout,
    ScoredRollout,
    build_train_batch,
    resolve_from_log,
    resolve_train_batch,
)
from ember.rollouts.config import parse_config
from ember.rollouts.etl import TopologyError, prepare_topics
from ember.rollouts.reader import RdkafkaRolloutFetcher, RolloutFetcher
from ember.rollouts.simulate import synthetic_rollout
from ember.rollouts.topics import Topics, TopicSpec, reference_retention_problem
from ember.rollouts.transport import producer_config
from ember.schemas import RolloutRef, decode_train_batch, encode, encode_train_batch
from ember.schemas.errors import DecodeError
from tests.rollouts.etl_support import etl_settings
from tests.rollouts.helpers import rollout

TOPIC = "claims.rollouts"


def _rollout(index: int, tokens: int, seed: int = 0):
    """A small rollout with routed experts (3 layers, top-8)."""
    rng = np.random.default_rng([index, seed])
    return synthetic_rollout(
        rng, group_id="g", prompt_id="p", num_tokens=tokens, prompt_tokens=4, layers=3, rollout_id=f"g-{index}", finish_reason="stop"
    )


def _sequences(lengths=(50, 90, 30, 70)) -> tuple[list[ScoredRollout], dict[tuple[str, int, int], bytes]]:
    """Scored rollouts with references to where they 'live', and that log."""
    rollouts = [_rollout(i, n) for i, n in enumerate(lengths)]
    log, sequences = {}, []
    for offset, (r, advantage) in enumerate(zip(rollouts, (0.5, -1.25, 2.0, -0.75))):
        value = encode(r)
        log[(TOPIC, 0, offset)] = value
        sequences.append(ScoredRollout(r, advantage, RolloutRef(TOPIC, 0, offset, hashlib.sha256(value).digest())))
    return sequences, log


def _build(sequences):
    return build_train_batch(sequences, step=3, source_offsets=[], created_at_us=7, advantage_estimator="grpo")


def test_a_by_reference_batch_resolves_to_exactly_the_inline_batch():
    sequences, log = _sequences()
    claim = _build(sequences)
    inline = _build([ScoredRollout(s.rollout, s.advantage) for s in sequences])
    assert claim.by_reference and claim.tokens is None and claim.routed_experts is None
    wire = encode_train_batch(claim)
    decoded = decode_train_batch(wire)
    assert inline.routed_experts is not None and len(wire) * 2 < len(encode_train_batch(inline)), "no per-token arrays"
    assert all(getattr(decoded, name) is None for name in ("tokens", "loss_mask", "advantages", "sampler_logprobs", "routed_experts"))
    assert decoded.rollout_refs == claim.rollout_refs and decoded.num_tokens == inline.num_tokens
    assert encode_train_batch(resolve_from_log(decoded, log)) == encode_train_batch(inline)


def test_a_share_resolves_to_its_slice_of_the_batch_and_reads_only_its_rollouts():
    sequences, log = _sequences()
    claim = decode_train_batch(encode_train_batch(_build(sequences)))
    inline = resolve_from_log(claim, log)
    bounds = share_bounds(claim.cu_seqlens, 2)
    read: list[RolloutRef] = []
    by_ref = {s.ref: s.rollout for s in sequences}

    def fetch(refs):
        read.extend(refs)
        return [by_ref[r] for r in refs]

    for rank in range(2):
        read.clear()
        share = rl_batch_share(encode_train_batch(claim), rank, 2, fetch=fetch)
        first, last = int(bounds[rank]), int(bounds[rank + 1])
        assert read == claim.rollout_refs[first:last], "a rank fetches its own share's rollouts, no others"
        start, end = int(claim.cu_seqlens[first]), int(claim.cu_seqlens[last])
        assert share.tokens.tolist() == inline.tokens[start:end].tolist()
        assert share.advantages.numpy().tolist() == inline.advantages[start:end].tolist()
        assert share.routed_experts.numpy().tobytes() == inline.routed_experts[start:end].tobytes()
    with pytest.raises(DecodeError, match="by reference: this trainer has no rollout source"):
        rl_batch_share(encode_train_batch(claim), 0, 1)


def test_a_changed_or_missing_rollout_is_named_by_its_reference():
    sequences, log = _sequences()
    claim = _build(sequences)
    changed = dict(log)
    changed[(TOPIC, 0, 2)] = encode(_rollout(2, 30, seed=99))
    with pytest.raises(MissingRollout, match=r"claims.rollouts\[0\]@2: the message there is not the one .*sha256"):
        resolve_from_log(claim, changed)
    with pytest.raises(MissingRollout, match=r"claims.rollouts\[0\]@1 is not in the log"):
        resolve_from_log(claim, {k: v for k, v in log.items() if k[2] != 1})
    swapped = [sequences[1].rollout, sequences[0].rollout, *(s.rollout for s in sequences[2:])]
    with pytest.raises(DecodeError, match=r"claims.rollouts\[0\]@0 holds rollout"):
        resolve_train_batch(claim, swapped)


def test_a_by_reference_batch_states_what_is_wrong_with_it():
    sequences, _log = _sequences()
    claim = _build(sequences)
    claim.rollout_refs = claim.rollout_refs[:-1]
    claim.tokens = np.zeros(claim.num_tokens, np.uint32)
    text = "; ".join(str(i) for i in claim.issues())
    assert "3 references for 4 rollouts" in text and "'tokens': must be absent in a by-reference batch" in text


def test_retention_must_cover_the_batches_that_reference_rollouts():
    week, day = str(7 * 86_400_000), str(86_400_000)
    assert reference_retention_problem({"retention.ms": week}, {"retention.ms": week}) is None
    assert reference_retention_problem({"retention.ms": "-1"}, {"retention.ms": "-1"}) is None
    assert "outlive the rollouts" in reference_retention_problem({"retention.ms": day}, {"retention.ms": week})
    assert "outlive the rollouts" in reference_retention_problem({"retention.ms": week}, {"retention.ms": "-1"})
    assert "retention.bytes" in reference_retention_problem({"retention.ms": week, "retention.bytes": "1000"}, {"retention.ms": day})
    specs = Topics("p").specs()
    assert reference_retention_problem(specs["rollouts"].configs(), specs["train_batches"].configs()) is None


# ---- against the broker ------------------------------------------------------------------------


@pytest.mark.integration
def test_the_etl_refuses_a_rollouts_topic_kept_shorter_than_its_batches(kafka):
    prefix = f"test-claim-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    ensure_topics(kafka, [TopicSpec(topics.rollouts, 1, retention_ms=3_600_000)])
    with pytest.raises(TopologyError, match=rf"{topics.rollouts}: the rollouts topic keeps data 3600000 ms .* outlive the rollouts"):
        prepare_topics(parse_config(etl_settings(prefix, partitions=1)), create=True)


@pytest.fixture(scope="module")
def claim_log(kafka):
    """Six small rollouts on a one-partition topic, and their references."""
    return published_rollouts(kafka, 6)


def published_rollouts(kafka: str, count: int):
    """`count` small rollouts written to a new one-partition topic: (the topic, the rollouts, their references)."""
    topic = f"test-claim-{uuid.uuid4().hex[:8]}.rollouts"
    ensure_topics(kafka, [TopicSpec(topic, 1, compression="producer")])
    rollouts = [rollout("g", i, tokens=16, seed=i) for i in range(count)]
    producer = KafkaProducer(**producer_config(bootstrap_servers=kafka))
    refs = []
    for r in rollouts:
        value = encode(r)
        sent = producer.send(topic, key=b"g", value=value).get(timeout=30)
        refs.append(RolloutRef(topic, sent.partition, sent.offset, hashlib.sha256(value).digest()))
    producer.close()
    return topic, rollouts, refs


FETCHERS = [RolloutFetcher, RdkafkaRolloutFetcher]


@pytest.mark.integration
@pytest.mark.parametrize("fetcher_class", FETCHERS, ids=["kafka-python", "confluent"])
def test_the_fetcher_skips_other_ranks_shares_and_goes_back(kafka, claim_log, fetcher_class):
    """A rank's shares skip the other ranks' rollouts (sought over by kafka-python's fetcher, read through by
    librdkafka's); a batch behind the position is sought back to. Either way each reference gets exactly its
    own message."""
    topic, rollouts, refs = claim_log
    fetcher = fetcher_class(bootstrap=kafka, timeout_s=20)
    try:
        for wanted in ([0, 1], [3, 4], [5], [2, 0]):
            assert [r.rollout_id for r in fetcher.rollouts([refs[i] for i in wanted])] == [rollouts[i].rollout_id for i in wanted]
        assert fetcher.bytes == sum(len(encode(rollouts[i])) for i in (0, 1, 3, 4, 5, 2, 0))
    finally:
        fetcher.close()


@pytest.mark.integration
def test_alternating_partitions_never_waits_out_the_clients_retry_backoff(kafka, monkeypatch):
    """A rank's batches alternate between shards, so its fetches alternate partitions. kafka-python parks a paused
    partition's fetched records and hands a resumed one's back only on a later call; polled with a timeout in
    between, it sleeps retry_backoff_ms (100 ms) at every switch, which once cost a rank seconds per GB. Past the
    first read of each partition the fetcher must never sleep there."""
    import sys

    import kafka.consumer.group as consumer_module

    topic = f"test-claim-{uuid.uuid4().hex[:8]}.rollouts"
    ensure_topics(kafka, [TopicSpec(topic, 2, compression="producer")])
    producer = KafkaProducer(**producer_config(bootstrap_servers=kafka))
    refs: dict[int, list[RolloutRef]] = {0: [], 1: []}
    for i in range(8):
        value = encode(rollout(f"g{i}", i, tokens=16, seed=i))
        sent = producer.send(topic, key=f"g{i}".encode(), value=value, partition=i % 2).get(timeout=30)
        refs[sent.partition].append(RolloutRef(topic, sent.partition, sent.offset, hashlib.sha256(value).digest()))
    producer.close()
    fetcher = RolloutFetcher(bootstrap=kafka, timeout_s=20)
    real_sleep, slept = consumer_module.time.sleep, []

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code.co_filename == consumer_module.__file__:
            slept.append(seconds)
        real_sleep(seconds)

    try:
        first = [fetcher.fetch(refs[p][:1]) for p in (0, 1)]  # a partition's first read may wait for its position
        monkeypatch.setattr(consumer_module.time, "sleep", sleep)
        later = [fetcher.fetch(refs[p][k : k + 1]) for k in range(1, 4) for p in (0, 1)]
    finally:
        fetcher.close()
    assert len(first) == 2 and all(len(values) == 1 for values in later)
    assert slept == [], f"the fetcher slept in kafka-python's poll at a partition switch: {slept}"


@pytest.mark.integration
@pytest.mark.parametrize("fetcher_class", FETCHERS, ids=["kafka-python", "confluent"])
def test_the_fetcher_checks_each_rollout_and_names_one_deleted_by_retention(kafka, fetcher_class):
    topic, rollouts, refs = published_rollouts(kafka, 4)
    fetcher = fetcher_class(bootstrap=kafka, timeout_s=20)
    try:
        assert [r.rollout_id for r in fetcher.rollouts([refs[2], refs[0]])] == [rollouts[2].rollout_id, rollouts[0].rollout_id]
        assert fetcher.bytes == len(encode(rollouts[2])) + len(encode(rollouts[0])), "only the referenced messages"
        forged = RolloutRef(topic, 0, refs[3].offset, hashlib.sha256(b"other bytes").digest())
        with pytest.raises(MissingRollout, match=rf"{topic}\[0\]@{refs[3].offset}: the message there is not the one"):
            fetcher.rollouts([forged])
        admin = _admin(kafka, None)
        admin.delete_records({TopicPartition(topic, 0): refs[2].offset})
        admin.close()
        with pytest.raises(MissingRollout, match=rf"{topic}\[0\]@{refs[1].offset} is gone: the partition now starts at offset {refs[2].offset} \(retention"):
            fetcher.rollouts([refs[1]])
    finally:
        fetcher.close()
