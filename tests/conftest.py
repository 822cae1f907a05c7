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


@pytest.fixture(scope="session")
def object_stores() -> dict[str, str]:
    """The real local object stores (infra/objectstores.sh: fake-gcs-server, moto's S3 server), and this process's
    environment pointed at them through the standard client settings (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, ...),
    which Beam's GCS and S3 FileSystems, and every subprocess started after this, pick up."""
    try:
        services.start("objectstores")
        settings = services.objectstores_env()
    except services.ServiceError as exc:
        pytest.fail(f"the object stores could not be started:\n{exc}")
    os.environ.update(settings)
    return settings


def _new_bucket(scheme: str) -> str:
    name = f"ember-test-{uuid.uuid4().hex[:12]}"
    if scheme == "gs":
        from google.cloud import storage

        storage.Client().create_bucket(name)
    else:
        import boto3

        boto3.client("s3").create_bucket(Bucket=name)
    return f"{scheme}://{name}"


@pytest.fixture
def gs_bucket(object_stores) -> str:
    """A fresh bucket on the local fake-gcs-server, as gs://NAME."""
    return _new_bucket("gs")


@pytest.fixture
def s3_bucket(object_stores) -> str:
    """A fresh bucket on the local moto S3 server, as s3://NAME."""
    return _new_bucket("s3")
