"""Fixtures that bring up the real local services via infra/*.sh.

The scripts are idempotent: if a service is already running they return quickly.
A service that cannot start fails the test run loudly (never skips) so a broken
local environment is not mistaken for passing tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from .infra_support import SlurmCluster, require_ok, run_infra, status_fields


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Start (or reuse) the local Kafka broker; returns '127.0.0.1:<port>'."""
    require_ok(run_infra("kafka.sh", "start", timeout=300), "infra/kafka.sh start")
    return require_ok(run_infra("kafka.sh", "bootstrap"), "infra/kafka.sh bootstrap").stdout.strip()


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Start (or reuse) the single-node Slurm cluster (munged, slurmctld, slurmd)."""
    require_ok(run_infra("slurm.sh", "start", timeout=600), "infra/slurm.sh start")
    conf = Path(require_ok(run_infra("slurm.sh", "conf"), "infra/slurm.sh conf").stdout.strip())
    return SlurmCluster(conf=conf, controller=status_fields("slurm.sh")[2])


@pytest.fixture()
def slurm_env(slurm_cluster: SlurmCluster) -> dict[str, str]:
    """Environment for Slurm client commands, pinned to the generated slurm.conf."""
    return {**os.environ, "SLURM_CONF": str(slurm_cluster.conf)}
