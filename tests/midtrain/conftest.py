"""Fixtures for the midtrain tests: the real local Slurm cluster, started through infra/."""

from __future__ import annotations

import pytest

from ember.dev import services
from tests.tokenize.support import hf_tokenizer_path  # noqa: F401  (a fixture)


@pytest.fixture(scope="session")
def slurm() -> None:
    """Starts (or reuses) the single-node Slurm cluster; fails loudly when it cannot."""
    try:
        services.start("slurm")
    except services.ServiceError as exc:
        pytest.fail(f"the local Slurm cluster could not be started:\n{exc}")
