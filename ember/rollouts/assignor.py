"""Cooperative-sticky partition assignment that keeps rollouts[p] and rewards[p] on one ETL process.

Kafka's CooperativeStickyAssignor balances each topic-partition independently, so a group's rollouts
and its rewards could land on different processes and never meet. This assignor balances *shards*
(partition index p across every subscribed topic) with the same guarantees: sticky (a member keeps
what it owns up to its fair share) and cooperative (KIP-429: a shard moving between members is first
revoked by its owner and only assigned to the new owner in the follow-up rebalance).
"""

from __future__ import annotations

from collections import defaultdict

from kafka.coordinator.assignors.abstract import AbstractPartitionAssignor, RebalanceProtocol
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment, ConsumerProtocolSubscription
from kafka.structs import TopicPartition


def balance_shards(members: list[str], owned: dict[str, set[int]], shards: list[int]) -> dict[str, set[int]]:
    """Sticky balanced assignment: sizes differ by at most one, owners keep shards up to their share."""
    if not members:
        return {}
    members = sorted(members)
    base, extra = divmod(len(shards), len(members))
    valid = set(shards)
    claimed: set[int] = set()
    keep: dict[str, list[int]] = {}
    for member in members:
        mine = sorted((owned.get(member, set()) & valid) - claimed)
        keep[member] = mine
        claimed.update(mine)
    order = sorted(members, key=lambda m: (-len(keep[m]), m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(order)}
    result: dict[str, set[int]] = {}
    free: list[int] = sorted(valid - claimed)
    for member in members:
        result[member] = set(keep[member][: quota[member]])
        free.extend(keep[member][quota[member] :])
    free.sort()
    for member in members:
        while len(result[member]) < quota[member]:
            result[member].add(free.pop(0))
    return result


class CopartitionedCooperativeAssignor(AbstractPartitionAssignor):
    """Pass an instance in `partition_assignment_strategy`; every ETL process must use it."""

    name = "ember-copartitioned-cooperative"
    version = 1

    def __init__(self) -> None:
        self.member_assignment: list[TopicPartition] | None = None
        self.generation = -1

    def supported_protocols(self) -> list[RebalanceProtocol]:
        return [RebalanceProtocol.COOPERATIVE]

    def metadata(self, topics):
        by_topic: dict[str, list[int]] = defaultdict(list)
        for tp in self.member_assignment or []:
            by_topic[tp.topic].append(tp.partition)
        owned = [
            ConsumerProtocolSubscription.TopicPartition(topic=t, partitions=sorted(p)) for t, p in sorted(by_topic.items())
        ]
        return ConsumerProtocolSubscription(
            version=self.version, topics=sorted(topics), user_data=b"", owned_partitions=owned
        )

    def on_assignment(self, assignment, generation) -> None:
        self.member_assignment = assignment.partitions()
        self.generation = generation

    def assign(self, cluster, members):
        subscriptions = {m.member_id: set(m.metadata.topics) for m in members}
        topics = sorted(set().union(*subscriptions.values())) if subscriptions else []
        counts = {t: len(cluster.partitions_for_topic(t) or ()) for t in topics}
        shards = list(range(max(counts.values(), default=0)))
        owned: dict[str, set[int]] = defaultdict(set)
        claims: dict[int, set[str]] = defaultdict(set)
        for member in members:
            for tp in getattr(member.metadata, "owned_partitions", None) or ():
                for partition in tp.partitions:
                    claims[partition].add(member.member_id)
        for shard, claimants in claims.items():
            if len(claimants) == 1:
                owned[next(iter(claimants))].add(shard)
        final = balance_shards(list(subscriptions), owned, shards)
        current = {s: next(iter(c)) for s, c in claims.items() if len(c) == 1}
        result = {}
        for member_id, assigned in final.items():
            now = {s for s in assigned if current.get(s) in (None, member_id)}
            parts = [
                (topic, sorted(s for s in now if s < counts[topic]))
                for topic in sorted(subscriptions[member_id])
            ]
            result[member_id] = ConsumerProtocolAssignment(self.version, [p for p in parts if p[1]], b"")
        return result
