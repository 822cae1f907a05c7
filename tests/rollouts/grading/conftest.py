"""The judge's real OpenAI-compatible server, shared by every module that talks to it (they share the
`judge_server` xdist group, so one worker starts it once: a minute of CPU on this machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.rollouts.grading.judge_server import JudgeServer, build_tiny_model


@pytest.fixture(scope="session")
def judge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JudgeServer]:
    root = tmp_path_factory.mktemp("judge-server")
    server = JudgeServer(build_tiny_model(root / "model"), root / "serve.log")
    server.start()
    yield server
    server.kill()
