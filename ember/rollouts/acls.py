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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ember.rollouts.topics import Topics

ROLES = ("inference", "grader", "etl", "trainer")


def default_user(role: str) -> str:
    """The SCRAM user of a role on the ember broker (`ember dev up` secured creates these)."""
    return f"ember-{role}"


@dataclass(frozen=True)
class Binding:
    """One ALLOW rule: `principal` may `operation` on the resource (`name`, matched LITERAL or PREFIXED), from any host."""

    role: str
    principal: str
    operation: Literal["READ", "WRITE", "DESCRIBE"]
    resource: Literal["TOPIC", "GROUP", "TRANSACTIONAL_ID"]
    name: str
    pattern: Literal["LITERAL", "PREFIXED"] = "LITERAL"


def role_bindings(
    prefix: str,
    *,
    etl_group: str | None = None,
    trainer_group: str | None = None,
    grader_group: str | None = None,
    users: dict[str, str] | None = None,
) -> list[Binding]:
    """Every role's bindings for the deployment `prefix`; groups default to `<prefix>-etl` / `<prefix>-trainer` /
    `<prefix>-grader`."""
    topics = Topics(prefix)
    etl_group = etl_group or f"{prefix}-etl"
    trainer_group = trainer_group or f"{prefix}-trainer"
    grader_group = grader_group or f"{prefix}-grader"
    names = {role: (users or {}).get(role, default_user(role)) for role in ROLES}
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
    return [
        Binding(role, f"User:{names[role]}", operation, resource, name, pattern)  # type: ignore[arg-type]
        for role, operation, resource, name, pattern in rules
    ]
