"""Creating and describing the ETL's topics, applying role ACLs, and waiting for a broker to be ready (Kafka's admin client)."""

from __future__ import annotations

import logging
import time

from kafka.admin import (
    ACL,
    ConfigResource,
    ConfigResourceType,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    KafkaAdminClient,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)
from kafka.errors import (
    AuthorizationError,
    ClusterAuthorizationFailedError,
    KafkaError,
    SaslAuthenticationFailedError,
    SecurityDisabledError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    TransactionalIdNotFoundError,
)

from ember.rollouts.acls import Binding
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import TopicSpec
from ember.rollouts.transport import READY_TIMEOUT_S, BrokerNotReady, client_config


log = logging.getLogger("ember.kafka")


class AdminRefused(RuntimeError):
    """The broker refused an admin operation; the message says which, as whom, and who can do it."""


def _admin(bootstrap: str, security: KafkaSecurity | None, **overrides: object) -> KafkaAdminClient:
    return KafkaAdminClient(**{**client_config(security), "bootstrap_servers": bootstrap, **overrides}, client_id="ember-admin")


def _not_ready(admin: KafkaAdminClient, topics: list[str], group_id: str | None, transactional_id: str | None) -> str | None:
    """What the broker does not serve yet, or None when all of it is there."""
    if topics:
        for row in admin.describe_topics(topics):
            if row["error_code"]:
                return f"metadata of topic {row['name']} (error code {row['error_code']})"
            leaderless = sorted(p["partition_index"] for p in row["partitions"] if p["leader_id"] < 0 or p["error_code"])
            if leaderless or not row["partitions"]:
                return f"leaders of topic {row['name']} partitions {leaderless or 'all'}"
    if group_id is not None:
        admin.describe_groups([group_id])  # finds the group coordinator: on a new broker, once __consumer_offsets exists
    if transactional_id is not None:
        try:
            admin.describe_transactions([transactional_id])  # the transaction coordinator (__transaction_state)
        except TransactionalIdNotFoundError:
            pass  # the coordinator answered: the id is simply new
    return None


def wait_until_ready(
    bootstrap: str,
    security: KafkaSecurity | None = None,
    *,
    topics: list[str] | tuple[str, ...] = (),
    group_id: str | None = None,
    transactional_id: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    who: str = "client",
) -> None:
    """Wait, at most `timeout_s`, until the broker serves metadata (every partition of `topics` has a leader),
    the coordinator of consumer group `group_id` and the transaction coordinator of `transactional_id`.

    On a freshly formatted broker the first FindCoordinator creates `__consumer_offsets` (and the first
    transactional producer `__transaction_state`); until they are loaded the coordinators answer
    NotCoordinator / CoordinatorNotAvailable. Raises `BrokerNotReady` naming what it waited for.
    """
    deadline = time.monotonic() + timeout_s
    waiting: str | None = "a connection"
    error: Exception | None = None
    logged = False
    while True:
        admin = None
        try:
            admin = _admin(bootstrap, security, request_timeout_ms=5000, bootstrap_timeout_ms=5000)
            waiting = _not_ready(admin, list(topics), group_id, transactional_id)
            error = None
        except (AuthorizationError, SaslAuthenticationFailedError):
            raise  # refused is not "not ready": waiting would only hide it
        except (KafkaError, OSError, ValueError) as exc:
            waiting = "an answer without errors" if admin is not None else "a connection"
            error = exc
        finally:
            if admin is not None:
                admin.close()
        if waiting is None:
            return
        if time.monotonic() >= deadline:
            wanted = ", ".join(
                [*(f"topic {t}" for t in topics), *([f"group {group_id}'s coordinator"] if group_id else []),
                 *([f"transaction coordinator of {transactional_id}"] if transactional_id else [])]
            ) or "metadata"
            raise BrokerNotReady(
                f"{who}: the broker at {bootstrap} was not ready within {timeout_s:.0f}s; waited for {wanted}, "
                f"still missing: {waiting}{f' ({error!r})' if error else ''}. Is it running (`ember dev status`), "
                "and are its internal topics (__consumer_offsets, __transaction_state) able to get a leader?"
            )
        if not logged:
            log.info("%s: waiting for %s on %s (a freshly formatted broker needs a few seconds)", who, waiting, bootstrap)
            logged = True
        time.sleep(0.5)


def ensure_topics(bootstrap: str, specs: list[TopicSpec], security: KafkaSecurity | None = None) -> dict[str, str]:
    """Create what is missing; returns each topic's outcome ('created' or 'exists')."""
    outcome: dict[str, str] = {}
    admin = _admin(bootstrap, security)
    try:
        existing = set(admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        for spec in specs:
            outcome[spec.name] = "exists"
        if missing:
            request = {
                s.name: {
                    "num_partitions": s.partitions,
                    "replication_factor": s.replication_factor,
                    "configs": s.configs(),
                }
                for s in missing
            }
            try:
                admin.create_topics(request, wait_for_metadata=True)
            except TopicAlreadyExistsError:
                pass
            except (TopicAuthorizationFailedError, ClusterAuthorizationFailedError):
                who = (security or KafkaSecurity()).describe()
                raise AdminRefused(
                    f"topics {', '.join(s.name for s in missing)} are missing, or hidden from {who}, who may not create "
                    "topics: an admin creates them (`ember rollouts topics create` with the admin's credentials) "
                    "and grants this role its ACLs (`ember rollouts acls --apply`)"
                ) from None
            for spec in missing:
                outcome[spec.name] = "created"
        return outcome
    finally:
        admin.close()


def list_topics(bootstrap: str, security: KafkaSecurity | None = None) -> list[str]:
    """Every topic this principal can see."""
    admin = _admin(bootstrap, security)
    try:
        return sorted(admin.list_topics())
    finally:
        admin.close()


def delete_topics(bootstrap: str, names: list[str], security: KafkaSecurity | None = None) -> list[str]:
    """Delete those of `names` that exist; returns what was deleted (an empty list deletes nothing)."""
    admin = _admin(bootstrap, security)
    try:
        present = [name for name in names if name in set(admin.list_topics())]
        if present:
            try:
                admin.delete_topics(present, timeout_ms=30_000)
            except (TopicAuthorizationFailedError, ClusterAuthorizationFailedError):
                who = (security or KafkaSecurity()).describe()
                raise AdminRefused(f"{who} may not delete {', '.join(present)}: an admin (a super user) deletes topics") from None
        return present
    finally:
        admin.close()


def describe_topics(bootstrap: str, names: list[str], security: KafkaSecurity | None = None) -> list[dict[str, object]]:
    admin = _admin(bootstrap, security)
    try:
        return [
            {
                "name": t["name"],
                "partitions": len(t["partitions"]),
                "error_code": t["error_code"],
            }
            for t in admin.describe_topics(names)
        ]
    finally:
        admin.close()


def _acl(binding: Binding) -> ACL:
    return ACL(
        principal=binding.principal,
        host="*",
        operation=ACLOperation[binding.operation],
        permission_type=ACLPermissionType.ALLOW,
        resource_pattern=ResourcePattern(
            ResourceType[binding.resource], binding.name, ACLResourcePatternType[binding.pattern]
        ),
    )


def apply_acls(bootstrap: str, bindings: list[Binding], security: KafkaSecurity | None = None) -> dict[Binding, str]:
    """Create the bindings the broker lacks (as an admin principal); returns each one's outcome ('created' or 'exists')."""
    admin = _admin(bootstrap, security)
    try:
        everything = ACLFilter(
            principal=None,
            host=None,
            operation=ACLOperation.ANY,
            permission_type=ACLPermissionType.ANY,
            resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY),
        )
        who = (security or KafkaSecurity()).describe()
        try:
            existing, _error = admin.describe_acls(everything)
        except SecurityDisabledError:
            raise AdminRefused(f"the broker at {bootstrap} has no authorizer: ACLs need the secured broker") from None
        except ClusterAuthorizationFailedError:
            raise AdminRefused(f"{who} may not read ACLs: apply them as a super user (the broker's admin)") from None
        present = set(existing)
        missing = [b for b in bindings if _acl(b) not in present]
        if missing:
            result = admin.create_acls([_acl(b) for b in missing])
            if result["failed"]:
                raise AdminRefused(
                    f"{len(result['failed'])} of {len(missing)} ACLs were refused ({result['failed'][0].__name__}): "
                    f"apply them as a super user (the broker's admin), not {who}"
                )
            _wait_until_enforced(admin, bootstrap, {_acl(b) for b in missing}, everything)
        return {b: ("created" if b in missing else "exists") for b in bindings}
    finally:
        admin.close()


def _wait_until_enforced(admin: KafkaAdminClient, bootstrap: str, created: set, everything: ACLFilter) -> None:
    """Until the broker's authorizer holds every created ACL, at most READY_TIMEOUT_S. The controller commits ACLs
    before the broker replays them: a client of the role, started at once, was refused (a producer's InitProducerId,
    a fatal error for it) on a broker under load. The broker answers DescribeAcls from that same authorizer."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        existing, _error = admin.describe_acls(everything)
        pending = created - set(existing)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise BrokerNotReady(
                f"the broker at {bootstrap} did not enforce {len(pending)} of the {len(created)} ACLs just created within "
                f"{READY_TIMEOUT_S:.0f}s (e.g. {next(iter(pending))}): is its metadata log behind (`ember dev status`)?"
            )
        time.sleep(0.1)


def topic_configs(bootstrap: str, names: list[str], security: KafkaSecurity | None = None) -> dict[str, dict[str, str]]:
    """Each topic's effective configs (defaults included), as strings by key."""
    admin = _admin(bootstrap, security)
    try:
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n, configs=None) for n in names], config_filter="all")
    finally:
        admin.close()
    return {
        name: {key: (entry.get("value") if isinstance(entry, dict) else entry) for key, entry in configs.items()}
        for by_name in found.values()
        for name, configs in by_name.items()
    }
