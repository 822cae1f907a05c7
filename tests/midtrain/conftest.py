"""Fixtures for the midtrain tests (the Slurm cluster's fixture is the suite's, in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import SINGLE_JOB_SERVICES, locked, run_shared_dir
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


SAMPLED_GROUPS = 6
"""Groups of 4 rollouts in the shared sample; a test takes the first groups it needs."""


@dataclass(frozen=True)
class SampledPolicy:
    """The tiny RL policy's initial checkpoint and `SAMPLED_GROUPS` groups sampled from it with perturbed routers
    (`rl_support sample`): one encoded batch per group, and the same rollouts and rewards as encoded records."""

    root: Path

    @property
    def init_checkpoint(self) -> Path:
        return self.root / "policy" / "checkpoints" / "step_00000000"

    def batches(self, groups: int) -> list[Path]:
        return sorted((self.root / "batches").glob("*.batch"))[:groups]

    def copy_batches(self, groups: int, directory: Path) -> Path:
        """The first `groups` batches, alone in `directory` (what `rl_support memory` trains on)."""
        directory.mkdir(parents=True, exist_ok=True)
        for path in self.batches(groups):
            shutil.copy(path, directory / path.name)
        return directory

    def records(self, groups: int) -> tuple[list, list]:
        """The rollouts and the rewards of the first `groups` groups, decoded."""
        from ember.schemas import decode

        rollouts, rewards = ([decode(p.read_bytes()) for p in sorted((self.root / "records").glob(f"*.{suffix}"))[: groups * 4]]
                             for suffix in ("rollout", "reward"))
        return rollouts, rewards

    def copy_records(self, groups: int, directory: Path) -> Path:
        """The rollouts and rewards of the first `groups` groups, alone in `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        for suffix in ("rollout", "reward"):
            for path in sorted((self.root / "records").glob(f"*.{suffix}"))[: groups * 4]:
                shutil.copy(path, directory / path.name)
        return directory


@pytest.fixture(scope="session")
def sampled_policy(tmp_path_factory) -> SampledPolicy:
    """One sample of the tiny policy for every test that only reads it (initial weights, batches, records).

    A megatron process costs ~10 s of CPU before it does anything, so the sample is taken once per test session:
    under pytest-xdist in the session's base directory, which all workers share, by the first worker to get its
    lock (the others wait for it and read the same files); without xdist in this session's own base directory.
    """
    from .rl_support import rl_config

    shared = run_shared_dir(tmp_path_factory)
    root = shared / "midtrain-sampled-policy"
    with locked(shared / "midtrain-sampled-policy.lock"):
        if not (root / "complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            policy = rl_config(root / "policy.yaml", root / "policy", "unused")
            result = subprocess.run(
                [sys.executable, "-m", "tests.midtrain.rl_support", "sample", str(policy), str(SAMPLED_GROUPS), str(root)],
                cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=400,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
            (root / "complete").write_text("")
    return SampledPolicy(root)
