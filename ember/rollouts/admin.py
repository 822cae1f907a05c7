"""Creating and describing the ETL's topics on a broker (Kafka's admin client), idempotently."""

from __future__ import annotations

from kafka.admin import KafkaAdminClient
from kafka.errors import TopicAlreadyExistsError

from ember.rollouts.topics import TopicSpec


def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> dict[str, str]:
    """Create what is missing; returns each topic's outcome ('created' or 'exists')."""
    outcome: dict[str, str] = {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ember-admin")
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
            for spec in missing:
                outcome[spec.name] = "created"
        return outcome
    finally:
        admin.close()


def describe_topics(bootstrap: str, names: list[str]) -> list[dict[str, object]]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ember-admin")
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
