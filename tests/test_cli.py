"""Every command answers --help; the command tree is what the README documents."""

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ember.cli import app


def command_paths(group, prefix=()):
    yield prefix
    for name, command in getattr(group, "commands", {}).items():
        yield from command_paths(command, prefix + (name,))


ALL = list(command_paths(get_command(app)))


def test_command_tree():
    assert {p for p in ALL if len(p) == 1} == {("dev",), ("demo",), ("rollouts",), ("corpus",), ("export",)}
    assert ("dev", "status") in ALL and ("rollouts", "topics", "create") in ALL
    assert {("corpus", "build"), ("corpus", "tokenize"), ("corpus", "report"), ("export", "megatron")} <= set(ALL)


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "ember")
def test_help(path):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
