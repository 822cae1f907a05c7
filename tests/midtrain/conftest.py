"""Fixtures for the midtrain tests (the Slurm cluster's fixture is the suite's, in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from tests.tokenize.support import hf_tokenizer_path  # noqa: F401  (a fixture)


@pytest.fixture(scope="package", autouse=True)
def passive_openmp_threads():
    """Every trainer, sampler and Slurm job these tests start waits for work with OMP_WAIT_POLICY=PASSIVE.

    Why: an idle OpenMP thread spins by default, which only pays off on cores of its own. Here a rank with
    2 threads shares 2 cores with its peer and the other tests' processes: the spinning threads took
    ~2.5 s per tiny 2-rank step instead of ~0.15 s. The policy changes how idle threads wait, not what
    any rank computes or how many threads it has. Package scope: set before this package's module
    fixtures start their runs, and gone again for the other packages' tests (xdist may interleave them).
    """
    with pytest.MonkeyPatch.context() as patch:
        if "OMP_WAIT_POLICY" not in os.environ:  # an explicit setting wins
            patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        yield
