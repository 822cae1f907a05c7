"""Shared fixtures: real local services, started idempotently through infra/ (never mocked, never skipped).

The suite runs in two phases (infra/test.sh): tests marked `serial` (they stop or restart a shared service)
run alone; the rest run on pytest-xdist workers with `--dist loadgroup`. Session fixtures are then per
worker, which is why every service start is idempotent. A test that uses a service with room for one job
at a time joins that service's xdist group (`SINGLE_JOB_SERVICES`), so its users run one after another on
one worker, while everything else runs beside them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ember.dev import services


def run_shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory this test run's xdist workers share (their base temp dirs' parent, unique to the run); without
    xdist, the session's own base temp dir. For work a session fixture does once for every worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes: the first worker does the shared work, the others wait for it."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def start(service: str, what: str) -> None:
    """Starts (or reuses) a service through infra/; a service that cannot start fails the test, never skips it."""
    try:
        services.start(service)
    except services.ServiceError as exc:
        pytest.fail(f"{what} could not be started:\n{exc}")


@pytest.fixture(scope="session")
def kafka() -> str:
    """Bootstrap address of the real KRaft broker that infra/kafka.sh runs on 127.0.0.1."""
    start("kafka", "the Kafka broker")
    from ember.rollouts.config import kafka_bootstrap

    return kafka_bootstrap()


SINGLE_JOB_SERVICES = {
    "slurm": "slurm",  # one node with 2 CPUs: a second test's job would queue behind the first's
    "slurm_cluster": "slurm",
    "slurm_env": "slurm",
    "flink_args": "flink",  # one session cluster whose TaskManagers and worker pool tests kill and restart
}
"""Fixture -> xdist group: the tests that use one of these share the service and run on one worker."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        groups = {SINGLE_JOB_SERVICES[name] for name in item.fixturenames if name in SINGLE_JOB_SERVICES}
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid} uses services of xdist groups {sorted(groups)}; it can join only one")
        for group in groups:
            item.add_marker(pytest.mark.xdist_group(group))


class XdistGroupIds:
    """Makes `--dist loadgroup` see the xdist groups on pytest 9.2 (pytest-dev/pytest-xdist#1386).

    pytest-xdist 3.8 tells its scheduler an item's group by appending `@group` to `item._nodeid` in each worker;
    pytest 9.2 builds `nodeid` from a structured id instead, so the suffix is lost and every group is spread over
    the workers as if unmarked. After xdist's own hook, an item whose node id still lacks its group gets it the
    way pytest 9.2 stores ids. A no-op without loadgroup, and once xdist's suffix takes effect again."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):  # set in xdist workers of a --dist loadgroup run
            return
        from _pytest.nodeid import NodeId

        for item in items:
            names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
            suffix = "@" + "_".join(sorted(names))
            if names and not item.nodeid.endswith(suffix):
                item._id = NodeId.parse(item.nodeid + suffix)


def pytest_configure(config: pytest.Config) -> None:
    # Registered by pytest-xdist, which the serial phase turns off (-p no:xdist): there --strict-markers would
    # refuse the groups pytest_collection_modifyitems adds (an INTERNALERROR before any test runs).
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker with the other tests of the group")
    config.pluginmanager.register(XdistGroupIds(), "ember-xdist-group-ids")


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Lists the `serial` tests the parallel phase left out (EMBER_SERIAL_TESTS names the file), so the serial
    phase runs exactly those without collecting the whole suite a second time."""
    target = os.environ.get("EMBER_SERIAL_TESTS")
    if target:
        serial = sorted(item.nodeid for item in items if item.get_closest_marker("serial"))
        tmp = f"{target}.{os.getpid()}"
        with open(tmp, "w") as out:
            out.write("".join(f"{nodeid}\n" for nodeid in serial))
        os.replace(tmp, target)


@pytest.fixture(scope="session", autouse=True)
def passive_openmp_threads():
    """Every trainer, sampler and Slurm job the tests start waits for work with OMP_WAIT_POLICY=PASSIVE.

    Why: an idle OpenMP thread spins by default, which only pays off on cores of its own. Here a rank with
    2 threads shares 2 cores with its peer and the other tests' processes: the spinning threads took
    ~2.5 s per tiny 2-rank step instead of ~0.15 s. The policy changes how idle threads wait, not what
    any rank computes or how many threads it has. Session scope: set before any module fixture starts a run.
    """
    with pytest.MonkeyPatch.context() as patch:
        if "OMP_WAIT_POLICY" not in os.environ:  # an explicit setting wins
            patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        yield


@pytest.fixture(scope="session")
def slurm() -> None:
    """Starts (or reuses) the single-node Slurm cluster; fails loudly when it cannot."""
    start("slurm", "the local Slurm cluster")


@pytest.fixture(scope="session")
def secure_kafka() -> services.SecureBroker:
    """The secured broker (infra/kafka-secure.sh): SASL_SSL + SCRAM-SHA-512, one principal per role, ACLs enforced."""
    start("kafka-secure", "the secured Kafka broker")
    try:
        return services.secure_broker()
    except services.ServiceError as exc:
        pytest.fail(f"the secured Kafka broker could not be started:\n{exc}")


@pytest.fixture
def secured(secure_kafka, tmp_path, capfd, caplog):
    """The secured deployment (tests/rollouts/etl_support.py), and a list for subprocess and CLI output; afterwards
    every output, log and error of the test, the files it wrote and the broker's logs are searched for each role's
    password."""
    from ember.rollouts.acls import ROLES
    from tests.rollouts.etl_support import Deployment

    caplog.set_level(logging.INFO)
    outputs: list[str] = []
    yield Deployment.secured(secure_kafka), outputs
    out, err = capfd.readouterr()
    sys.stdout.write(out)
    sys.stderr.write(err)
    passwords = {secure_kafka.password_file(role).read_text().strip() for role in ("admin", *ROLES)}
    assert all(len(p) >= 8 for p in passwords)
    texts = {"captured stdout": out, "captured stderr": err, "log records": caplog.text}
    texts.update({f"subprocess output {i}": text for i, text in enumerate(outputs)})
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    broker_logs = [p for p in (secure_kafka.credentials.parent / "logs").rglob("*") if p.is_file()]
    assert broker_logs, "no broker logs to search"
    texts.update({str(p): p.read_text(errors="replace") for p in written + broker_logs})
    leaks = sorted(where for where, text in texts.items() if any(p in text for p in passwords))
    assert not leaks, f"a password appears in: {leaks}"


@pytest.fixture
def topic_prefix() -> str:
    """A fresh topic prefix per test so tests never read each other's records."""
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def object_stores() -> dict[str, str]:
    """The real local object stores (infra/objectstores.sh: fake-gcs-server, moto's S3 server), and this process's
    environment pointed at them through the standard client settings (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, ...),
    which Beam's GCS and S3 FileSystems, and every subprocess started after this, pick up."""
    start("objectstores", "the object stores")
    try:
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
