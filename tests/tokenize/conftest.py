"""Fixtures shared with tests/pipelines live in support.py."""

from tests.tokenize.support import hf_tokenizer_path  # noqa: F401  (a fixture)
