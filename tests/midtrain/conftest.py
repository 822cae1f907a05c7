"""Fixtures for the midtrain tests (the Slurm cluster's fixture is the suite's, in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import SINGLE_JOB_SERVICES
from tests.tokenize.support import hf_tokenizer_path  # noqa: F401  (a fixture)

SHARED_RUNS = {"two_ranks", "ranked_runs", "batches", "run"}
"""Module fixtures that train (or sample and train) once for all the tests of their module that read the result.

Under pytest-xdist a module fixture is per worker: were a module's readers spread over three workers, each would
train the whole run again. Every test that uses one of these (defined in its own module) joins an xdist group of
the module and fixture, so the run happens once, on one worker, while the other groups run beside it."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        shared = sorted(name for name in item.fixturenames if name in SHARED_RUNS and hasattr(item.module, name))
        if not shared:
            continue
        services = sorted(name for name in item.fixturenames if name in SINGLE_JOB_SERVICES)
        if services:  # xdist would put it in a group of both names, apart from both groups' other tests
            raise pytest.UsageError(f"{item.nodeid} uses the shared run {shared[0]} and the service fixture {services[0]}")
        item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}.{shared[0]}"))
