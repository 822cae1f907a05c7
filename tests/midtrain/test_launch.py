"""`midtrain launch`: the rendered sbatch script and the errors a user can act on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember.midtrain.cli import app
from ember.midtrain.config import load_config
from ember.midtrain.launch import LaunchRequest, render_sbatch

from .configs import tiny_run

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("launch"), steps=4, save_interval=2)


def _out(result) -> str:
    return " ".join(result.output.split())


def test_rendered_script_requeues_on_usr1_and_keys_logs_by_restart(config_path):
    config = load_config(config_path)
    request = LaunchRequest(config_path, nodes=2, gpus_per_node=8, procs_per_node=8, partition="gpu", time="04:00:00", signal_seconds=300)
    script = render_sbatch(config, request)
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={config.run_dir}/logs/slurm-%j.out",
        "RESTART=${SLURM_RESTART_COUNT:-0}",
        f'TRAIN_LOG="{config.run_dir}/logs/train-${{SLURM_JOB_ID}}-${{RESTART}}.log"',
        "trap 'forward USR1' USR1",
        'scontrol requeue "$SLURM_JOB_ID"',
        '--rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" \\',
    ]:
        assert line in script.splitlines() or line in script, line
    assert "--nproc-per-node 8" in script
    assert f"-m ember.midtrain.train {config_path.resolve()}" in script
    assert "%%" not in script
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_dry_run_prints_the_script_and_submits_nothing(config_path):
    result = runner.invoke(app, ["launch", str(config_path), "--dry-run", "--procs-per-node", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("#!/bin/bash")
    assert "--nproc-per-node 2" in result.output
    assert not (load_config(config_path).run_dir / "sbatch.sh").exists()


def test_invalid_config_names_the_key(tmp_path, config_path):
    data = yaml.safe_load(config_path.read_text())
    data["moe"]["num_expert"] = 8
    bad = config_path.parent / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["launch", str(bad), "--dry-run"])
    assert result.exit_code == 2
    assert "moe.num_expert: unknown key" in _out(result)


def test_missing_and_incomplete_shard_sets_are_refused(tmp_path):
    path = tiny_run(tmp_path, steps=4, save_interval=2)
    (tmp_path / "web" / "manifest.json").unlink()
    result = runner.invoke(app, ["launch", str(path), "--dry-run"])
    assert result.exit_code == 2 and "not a finished shard set" in _out(result)
    data = yaml.safe_load(path.read_text())
    data["data"]["shard_sets"] = [{"path": "nowhere"}]
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["launch", str(path), "--dry-run"])
    assert result.exit_code == 2 and "shard set" in _out(result) and "nowhere does not exist" in _out(result)


def test_layouts_that_cannot_split_the_batch_are_refused(config_path):
    result = runner.invoke(app, ["launch", str(config_path), "--dry-run", "--procs-per-node", "3"])
    assert result.exit_code == 2
    assert "global_batch_size 8 is not a multiple of micro_batch_size 2 x data-parallel size 3" in _out(result)


def test_no_sbatch_on_path(config_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = runner.invoke(app, ["launch", str(config_path)])
    assert result.exit_code == 1 and "sbatch is not on PATH" in _out(result)


@pytest.mark.integration
def test_partition_limits_come_from_the_real_cluster(config_path, slurm):
    result = runner.invoke(app, ["launch", str(config_path), "--gpus-per-node", "1"])
    assert result.exit_code == 2
    assert "--gpus-per-node 1: partition 'debug' has 0 GPU(s) per node; use --gpus-per-node 0 for a CPU run" in _out(result)
    result = runner.invoke(app, ["launch", str(config_path), "--nodes", "2", "--procs-per-node", "2"])
    assert result.exit_code == 2 and "--nodes 2: partition 'debug' has 1 node(s)" in _out(result)
    result = runner.invoke(app, ["launch", str(config_path), "--partition", "no-such-partition"])
    assert result.exit_code == 2 and "partition 'no-such-partition' does not exist" in _out(result)


@pytest.mark.integration
def test_status_of_an_unknown_job(slurm):
    result = runner.invoke(app, ["status", "999999"])
    assert result.exit_code == 2 and "job 999999 is not known to slurmctld" in _out(result)


def test_threads_set_cpus_per_task_omp_and_the_trainer_flag(config_path, tmp_path):
    result = runner.invoke(app, ["launch", str(config_path), "--dry-run", "--procs-per-node", "2", "--threads", "3"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --cpus-per-task=6" in result.output.splitlines()
    assert "export OMP_NUM_THREADS=3" in result.output.splitlines()
    assert f"-m ember.midtrain.train {config_path.resolve()} --threads 3 " in result.output
    data = yaml.safe_load(config_path.read_text())
    data["parallel"] = {"threads": 4}
    configured = config_path.parent / "threads.yaml"
    configured.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["launch", str(configured), "--dry-run", "--procs-per-node", "2"])
    assert "#SBATCH --cpus-per-task=8" in result.output.splitlines() and "--threads 4 " in result.output
    result = runner.invoke(app, ["launch", str(configured), "--dry-run", "--threads", "1"])
    assert "#SBATCH --cpus-per-task=1" in result.output.splitlines() and "export OMP_NUM_THREADS=1" in result.output


def _midtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.midtrain.cli", *args], capture_output=True, text=True, timeout=300)


def test_train_reports_data_and_layout_errors_before_distributed_init(tmp_path):
    """What `launch --dry-run` refuses, `train` refuses the same way: one line, no rank traceback."""
    path = tiny_run(tmp_path, steps=4, save_interval=2)
    good = yaml.safe_load(path.read_text())
    bad = {**good, "model": {**good["model"], "vocab_size": 999}}
    path.write_text(yaml.safe_dump(bad))
    for nproc in ("1", "2"):
        result = _midtrain("train", str(path), "--nproc-per-node", nproc)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "vocab_size" in result.stderr and "999" in result.stderr
        assert "Traceback" not in result.stderr + result.stdout and "[rank" not in result.stderr
    path.write_text(yaml.safe_dump(good))
    result = _midtrain("train", str(path), "--nproc-per-node", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "global_batch_size 8 is not a multiple of micro_batch_size 2 x data-parallel size 3" in " ".join(result.stderr.split())
    assert not (tmp_path / "run").exists()


def test_the_rank_entry_point_refuses_a_bad_config_in_one_line(tmp_path):
    """`python -m ember.midtrain.train` (what torchrun and the sbatch script run) checks before megatron loads."""
    path = tiny_run(tmp_path, steps=4, save_interval=2)
    data = yaml.safe_load(path.read_text())
    data["model"]["vocab_size"] = 999
    path.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-m", "ember.midtrain.train", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("[midtrain] ") and "model.vocab_size is 999" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_rl_refuses_a_missing_init_checkpoint_before_megatron(tmp_path):
    data = yaml.safe_load((REPO / "ember" / "midtrain" / "examples" / "rl_tiny_cpu.yaml").read_text())
    data.update(run_dir=str(tmp_path / "run"), init_checkpoint=str(tmp_path / "no-such-step"))
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(data))
    result = _midtrain("rl", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"init_checkpoint {tmp_path / 'no-such-step'} is not a checkpoint (does not exist)" in " ".join(result.stderr.split())
    result = runner.invoke(app, ["launch", str(path), "--mode", "rl", "--dry-run"])
    assert result.exit_code == 2 and "is not a checkpoint" in _out(result)
