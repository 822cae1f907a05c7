"""The issue-26 decompression bomb against the real broker: a valid rollout plus an unknown column of 2x10^9
zeros, its IPC body zstd-compressed (a 64.6 KB message that decoded to 2.0 GB), is dead-lettered as
malformed by a real `ember rollouts etl` process whose peak memory barely moves, and the partition goes
on; the trainer's `RolloutFetcher`, handed a batch that references it, refuses it the same way.
"""

from __future__ import annotations

import hashlib
import resource
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer

from ember.rollouts.admin import ensure_topics
from ember.rollouts.batching import ScoredRollout, build_train_batch
from ember.rollouts.reader import RolloutFetcher
from ember.rollouts.topics import Topics, TopicSpec
from ember.rollouts.transport import producer_config
from ember.schemas import DecodeError, RolloutRef, encode
from tests.rollouts.etl_support import Deployment, EtlProcess, books, finish, ledger_counts, setup_etl
from tests.rollouts.helpers import reward, rollout
from tests.schemas.strategies import arrow_message_with, arrow_pool, zeros_column

pytestmark = pytest.mark.integration

BOMB_ZEROS = 2 * 10**9
EXTRA_BYTES = 200 * 2**20  # the bomb expanded is 2.0 GB; refused, it costs the process next to nothing
CAUSE = "record batch message's body is zstd-compressed: ember refuses compressed bodies"


def bomb_of(group: str) -> tuple[bytes, object]:
    """A rollout that passes every check, and the same rollout carrying the bomb as an unknown column."""
    honest = rollout(group, 0)
    return arrow_message_with(encode(honest), "zstd", future=zeros_column(BOMB_ZEROS)), honest


def peak_rss(pid: int) -> int:
    """The process's resident-memory high-water mark (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def publish_group(producer: KafkaProducer, topics: Topics, group: str) -> None:
    for i, score in enumerate((0.0, 0.25, 0.5, 1.0)):
        r = rollout(group, i)
        producer.send(topics.rollouts, key=group.encode(), value=encode(r))
        producer.send(topics.rewards, key=group.encode(), value=encode(reward(r, score)))
    producer.flush(timeout=30)


def wait_for_ledger(topics: Topics, proc: EtlProcess, messages: int, timeout_s: float = 120.0) -> None:
    """Until the ledger accounts for `messages` rollout messages, batched, dropped or dead-lettered."""
    deadline = time.monotonic() + timeout_s
    while sum(seen := ledger_counts(topics.outcomes)) < messages:
        assert proc.proc.poll() is None, f"the ETL died:\n{proc.output()[-3000:]}"
        assert time.monotonic() < deadline, f"the ledger accounts for {seen} (rollouts, dead letters), not {messages} messages"
        time.sleep(0.5)


def test_the_etl_dead_letters_the_bomb_with_bounded_memory_and_goes_on(kafka, tmp_path, processes):
    _prefix, _config, topics = setup_etl(tmp_path, Deployment.plaintext(), partitions=1)
    bomb, _honest = bomb_of("bomb")
    assert len(bomb) < 100_000
    proc = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(proc)
    producer = KafkaProducer(**producer_config(bootstrap_servers=kafka))
    try:
        publish_group(producer, topics, "before")  # warms every path a message takes, batching included
        wait_for_ledger(topics, proc, 4)
        before = peak_rss(proc.proc.pid)
        producer.send(topics.rollouts, key=b"bomb", value=bomb)
        publish_group(producer, topics, "after")
        wait_for_ledger(topics, proc, 9)
        extra = peak_rss(proc.proc.pid) - before
    finally:
        producer.close()
    finish([proc])
    found = books(topics)
    assert len(found.dead_letters) == 1, f"no dead letter: {found.batched} batched"
    (dead,) = found.dead_letters
    assert (dead.reason, dead.offset) == ("malformed", 4) and CAUSE in dead.detail["error"], dead
    (record,) = found.dead_letter_records
    headers = dict(record.headers)
    assert headers["ember.reason"] == b"malformed" and CAUSE.encode() in headers["ember.detail"]
    assert record.value == bomb, "a malformed payload is kept for inspection"
    assert sorted(found.batched) == sorted(f"{g}-{i}" for g in ("before", "after") for i in range(4)), "the partition went on"
    assert extra < EXTRA_BYTES, f"the ETL's peak RSS grew {extra / 2**20:.0f} MiB on the bomb"


def test_the_fetcher_refuses_a_referenced_bomb_naming_the_reference(kafka):
    """A batch an older ETL wrote (it admitted the bomb) or a forged one: resolving it is a DecodeError."""
    topic = f"test-bomb-{uuid.uuid4().hex[:8]}.rollouts"
    ensure_topics(kafka, [TopicSpec(topic, 1, compression="producer")])
    bomb, honest = bomb_of("g")
    producer = KafkaProducer(**producer_config(bootstrap_servers=kafka))
    sent = producer.send(topic, key=b"g", value=bomb).get(timeout=30)
    producer.close()
    ref = RolloutRef(topic, sent.partition, sent.offset, hashlib.sha256(bomb).digest())
    batch = build_train_batch([ScoredRollout(honest, 0.5, ref)], step=1, source_offsets=[], created_at_us=0)
    fetcher = RolloutFetcher(bootstrap=kafka, timeout_s=30)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with arrow_pool() as pool, pytest.raises(DecodeError, match=rf"rollout {topic}\[0\]@{sent.offset}: the {CAUSE}"):
            fetcher.resolve(batch)
    finally:
        fetcher.close()
    assert fetcher.bytes == len(bomb)
    assert pool.max_memory() < 2**20, f"Arrow allocated {pool.max_memory()} bytes for the bomb"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before < EXTRA_BYTES
