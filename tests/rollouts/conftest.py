"""Fixtures shared by the rollouts tests that run real ETL processes."""

from __future__ import annotations

import pytest

from tests.rollouts.etl_support import EtlProcess


@pytest.fixture
def processes():
    """Every ETL process a test starts; whatever is still running at the end is killed."""
    started: list[EtlProcess] = []
    yield started
    for proc in started:
        if proc.proc.poll() is None:
            proc.kill()
