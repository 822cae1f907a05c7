"""Fixtures for the midtrain tests (the Slurm cluster's fixture is the suite's, in tests/conftest.py)."""

from __future__ import annotations

from tests.tokenize.support import hf_tokenizer_path  # noqa: F401  (a fixture)
