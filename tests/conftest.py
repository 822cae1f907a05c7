"""Shared fixtures: real local services, started idempotently through infra/ (never mocked, never skipped)."""

from __future__ import annotations

import os
import uuid

import pytest

from ember.dev import services


@pytest.fixture(scope="session")
def kafka() -> str:
    """Bootstrap address of the real KRaft broker that infra/kafka.sh runs on 127.0.0.1."""
    try:
        services.start("kafka")
    except services.ServiceError as exc:
        pytest.fail(f"the Kafka broker could not be started:\n{exc}")
    from ember.rollouts.config import kafka_bootstrap

    return kafka_bootstrap()


@pytest.fixture(scope="session")
def secure_kafka() -> services.SecureBroker:
    """The secured broker (infra/kafka-secure.sh): SASL_SSL + SCRAM-SHA-512, one principal per role, ACLs enforced."""
    try:
        services.start("kafka-secure")
        return services.secure_broker()
    except services.ServiceError as exc:
        pytest.fail(f"the secured Kafka broker could not be started:\n{exc}")


@pytest.fixture
def topic_prefix() -> str:
    """A fresh topic prefix per test so tests never read each other's records."""
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
