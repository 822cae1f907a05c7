"""Every command answers --help; the command tree is what the README documents; a config error needs no heavy import."""

import os
import subprocess
import sys
from pathlib import Path

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


HEAVY = ("apache_beam", "torch", "megatron", "kafka")
REPO = Path(__file__).resolve().parents[1]


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}  # wide: rich would wrap the path
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_config_and_cli_modules_import_no_beam_torch_megatron_or_kafka():
    modules = [
        "ember.cli", "ember.midtrain.cli", "ember.configs", "ember.pipelines.corpus.config", "ember.tokenize.config",
        "ember.midtrain.config", "ember.midtrain.config", "ember.rollouts.config",
    ]
    code = f"import sys, {', '.join(modules)}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)}))"
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("command", "config"),
    [
        (["ember.cli", "corpus", "build"], "sources: []\noutput: {directory: out, rows_per_shrad: 1}\n"),
        (["ember.cli", "corpus", "tokenize"], "output_dir: out\nsources: []\n"),
        (["ember.cli", "rollouts", "etl"], "groups: {size: 0}\n"),
        (["ember.cli", "rollouts", "sample"], "generation: {group_size: 0}\n"),
        (["ember.cli", "rollouts", "grade"], "graders: []\n"),
        (["ember.midtrain.cli", "train"], "model: {}\n"),
    ],
    ids=["corpus build", "corpus tokenize", "rollouts etl", "rollouts sample", "rollouts grade", "midtrain train"],
)
def test_a_config_error_comes_before_any_heavy_import(tmp_path, command, config):
    # Was: `corpus build` imported Beam (and `rollouts etl` Kafka) before reading the config: ~7-20 s to the first error.
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    result = _python("-X", "importtime", "-m", *command, str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{path} is invalid" in result.stdout + result.stderr
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
