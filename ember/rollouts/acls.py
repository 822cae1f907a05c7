"""Least privilege for the rollout stream: which principal may do what on which topic, group and transactional id.

Pure data, no Kafka client: `role_bindings(prefix)` is what `ember rollouts acls` prints and applies
(as the admin, through `ember.rollouts.admin.apply_acls`). Topic names come from `Topics(prefix)`.
Kafka's authorizer lets READ and WRITE imply DESCRIBE, and WRITE on a topic imply IDEMPOTENT_WRITE,
so those are not listed. No role gets CREATE: topics are created by the admin (a super user).

- inference: writes rollouts, and with `source: product` the product's user events (the serving side logs both).
- grader: reads rollouts with its own consumer group; writes rewards and dead-letter (rollouts it cannot
  grade); owns the transactional ids `<group>-<instance>` it commits rewards and offsets with.
- etl: reads rollouts, rewards, events, opt-out (written by the admin or a privacy service), policy-versions; writes train-batches, dead-letter, outcomes (its
  ledger, which it also reads for `ember rollouts stats`) and etl-state (which it reads back on
  recovery); owns its consumer group and the transactional ids `<group>-<instance>` it commits with.
- trainer: reads train-batches with its group, and rollouts (by assign, no group: the batches are by
  reference, every trainer rank fetches its share's rollouts); writes policy-versions.
- mirror (MirrorMaker 2 between secured regions and central, infra/regions.sh --secure): reads a region's rollouts
  and rewards and central's policy-versions (and their configs, which it copies); everything else it needs is
  MM2's own (`mirror_cluster_bindings`), not a deployment's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ember.rollouts.topics import Topics

ROLES = ("inference", "grader", "etl", "trainer")  # a deployment's roles; "mirror" (MM2) only exists with secured regions


def default_user(role: str) -> str:
    """The SCRAM user of a role on the ember broker (`ember dev up` secured creates these)."""
    return f"ember-{role}"


@dataclass(frozen=True)
class Binding:
    """One ALLOW rule: `principal` may `operation` on the resource (`name`, matched LITERAL or PREFIXED), from any host."""

    role: str
    principal: str
    operation: Literal["READ", "WRITE", "DESCRIBE", "CREATE", "ALTER", "ALTER_CONFIGS", "DESCRIBE_CONFIGS", "IDEMPOTENT_WRITE"]
    resource: Literal["TOPIC", "GROUP", "TRANSACTIONAL_ID", "CLUSTER"]
    name: str
    pattern: Literal["LITERAL", "PREFIXED"] = "LITERAL"


def role_bindings(
    prefix: str,
    *,
    etl_group: str | None = None,
    trainer_group: str | None = None,
    grader_group: str | None = None,
    users: dict[str, str] | None = None,
    regions: tuple[str, ...] | list[str] = (),
) -> list[Binding]:
    """Every role's bindings for the deployment `prefix` on the central cluster; groups default to `<prefix>-etl` /
    `<prefix>-trainer` / `<prefix>-grader`. With `regions` (mirrored in by MM2), the ETL also reads each region's
    copies and MM2's offsets there (replication lag), and the mirror reads the policy versions it sends out."""
    topics = Topics(prefix)
    etl_group = etl_group or f"{prefix}-etl"
    trainer_group = trainer_group or f"{prefix}-trainer"
    grader_group = grader_group or f"{prefix}-grader"
    rules: list[tuple[str, str, str, str, str]] = [
        ("inference", "WRITE", "TOPIC", topics.rollouts, "LITERAL"),
        ("inference", "WRITE", "TOPIC", topics.events, "LITERAL"),
        ("grader", "WRITE", "TOPIC", topics.rewards, "LITERAL"),
        ("grader", "WRITE", "TOPIC", topics.dead_letter, "LITERAL"),
        ("grader", "READ", "TOPIC", topics.rollouts, "LITERAL"),
        ("grader", "READ", "GROUP", grader_group, "LITERAL"),
        ("grader", "WRITE", "TRANSACTIONAL_ID", f"{grader_group}-", "PREFIXED"),
        ("grader", "DESCRIBE", "TRANSACTIONAL_ID", f"{grader_group}-", "PREFIXED"),
        *[("etl", "READ", "TOPIC", name, "LITERAL") for name in (topics.rollouts, topics.rewards, topics.events, topics.opt_out, topics.policy_versions)],
        *[
            ("etl", "WRITE", "TOPIC", name, "LITERAL")
            for name in (topics.train_batches, topics.dead_letter, topics.outcomes, topics.etl_state)
        ],
        ("etl", "READ", "TOPIC", topics.etl_state, "LITERAL"),
        ("etl", "READ", "TOPIC", topics.outcomes, "LITERAL"),
        ("etl", "READ", "GROUP", etl_group, "LITERAL"),
        ("etl", "WRITE", "TRANSACTIONAL_ID", f"{etl_group}-", "PREFIXED"),
        ("etl", "DESCRIBE", "TRANSACTIONAL_ID", f"{etl_group}-", "PREFIXED"),
        ("trainer", "READ", "TOPIC", topics.train_batches, "LITERAL"),
        ("trainer", "READ", "TOPIC", topics.rollouts, "LITERAL"),
        ("trainer", "READ", "GROUP", trainer_group, "LITERAL"),
        ("trainer", "WRITE", "TOPIC", topics.policy_versions, "LITERAL"),
    ]
    for region in regions:
        rules += [
            *[("etl", "READ", "TOPIC", f"{region}.{name}", "LITERAL") for name in (topics.rollouts, topics.rewards)],
            ("etl", "READ", "TOPIC", f"mm2-offsets.{region}.internal", "LITERAL"),
        ]
    if regions:
        rules += [("mirror", op, "TOPIC", topics.policy_versions, "LITERAL") for op in ("READ", "DESCRIBE_CONFIGS")]
    return _bindings(rules, users)


def region_bindings(prefix: str, *, grader_group: str | None = None, users: dict[str, str] | None = None) -> list[Binding]:
    """The bindings of the deployment `prefix` on a region's own cluster: inference samples there, graders grade
    there, the ETL reads there what the mirror has not copied yet (`RegionProofs`), and the mirror copies rollouts
    and rewards out (READ, and DESCRIBE_CONFIGS: it makes the central copy with the region topic's configs)."""
    topics = Topics(prefix)
    grader_group = grader_group or f"{prefix}-grader"
    rules: list[tuple[str, str, str, str, str]] = [
        ("inference", "WRITE", "TOPIC", topics.rollouts, "LITERAL"),
        ("grader", "WRITE", "TOPIC", topics.rewards, "LITERAL"),
        ("grader", "READ", "TOPIC", topics.rollouts, "LITERAL"),
        ("grader", "READ", "GROUP", grader_group, "LITERAL"),
        ("grader", "WRITE", "TRANSACTIONAL_ID", f"{grader_group}-", "PREFIXED"),
        ("grader", "DESCRIBE", "TRANSACTIONAL_ID", f"{grader_group}-", "PREFIXED"),
        *[("etl", "READ", "TOPIC", name, "LITERAL") for name in (topics.rollouts, topics.rewards)],
        *[("mirror", op, "TOPIC", name, "LITERAL") for name in (topics.rollouts, topics.rewards) for op in ("READ", "DESCRIBE_CONFIGS")],
    ]
    return _bindings(rules, users)


def mirror_cluster_bindings(sources: list[str], user: str | None = None) -> list[Binding]:
    """What MirrorMaker 2 (dedicated mode, exactly-once source) needs on one cluster, whatever the deployments:
    `sources` are the aliases it copies into this cluster (central: the regions; a region: central).

    Per source `s`, MM2 runs a Connect worker against this cluster with group `s-mm2` and internal topics
    `mm2-{configs,offsets,status}.s.internal`; with exactly.once.source.support=enabled the worker's leader writes
    the config topic with transactional id `connect-cluster-s-mm2` and each task with `s-mm2-<connector>-<task>`
    (Kafka's Connect docs, "ACL requirements", and MirrorMakerConfig.workerConfig). It creates, writes and alters
    the copies `s.<topic>`, and reads them too (central -> region copies every heartbeats topic in central, the
    regions' `s.heartbeats` among them), writes `heartbeats` (copied the other way), and keeps `mm2-offset-syncs.*.internal`
    where this cluster is the source. IdempotentWrite on the cluster is only needed by brokers before 2.8, but
    Connect's docs list it. Data topics are granted per deployment (`role_bindings`/`region_bindings`), not here."""
    rules: list[tuple[str, str, str, str, str]] = [
        *[("mirror", op, "TOPIC", "mm2-", "PREFIXED") for op in ("CREATE", "READ", "WRITE", "DESCRIBE_CONFIGS")],
        *[("mirror", op, "TOPIC", "heartbeats", "LITERAL") for op in ("CREATE", "READ", "WRITE", "DESCRIBE_CONFIGS")],
        ("mirror", "IDEMPOTENT_WRITE", "CLUSTER", "kafka-cluster", "LITERAL"),
    ]
    for source in sources:
        rules += [
            *[("mirror", op, "TOPIC", f"{source}.", "PREFIXED") for op in ("CREATE", "READ", "WRITE", "ALTER", "ALTER_CONFIGS", "DESCRIBE_CONFIGS")],
            ("mirror", "READ", "GROUP", f"{source}-mm2", "LITERAL"),
            *[("mirror", op, "TRANSACTIONAL_ID", f"connect-cluster-{source}-mm2", "LITERAL") for op in ("WRITE", "DESCRIBE")],
            *[("mirror", op, "TRANSACTIONAL_ID", f"{source}-mm2-", "PREFIXED") for op in ("WRITE", "DESCRIBE")],
        ]
    return _bindings(rules, {"mirror": user} if user else None)


def _bindings(rules: list[tuple[str, str, str, str, str]], users: dict[str, str] | None) -> list[Binding]:
    return [
        Binding(role, f"User:{(users or {}).get(role, default_user(role))}", operation, resource, name, pattern)  # type: ignore[arg-type]
        for role, operation, resource, name, pattern in rules
    ]
