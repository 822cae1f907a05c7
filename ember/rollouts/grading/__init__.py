"""Graders: sandboxed unit tests and an LLM judge that turn rollouts into rewards."""
