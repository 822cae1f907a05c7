"""The `midtrain` command line: train, launch on Slurm, job status and logs.

Imports stay light at module level: megatron-core loads only inside `train`, and this module is
what multiprocessing re-imports in dist_checkpointing's spawned helper process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Megatron-core MoE mid-training on ember shard sets, locally or on Slurm.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


def _load(config: Path, rl: bool = False):
    """The validated config, or its errors and exit code 2."""
    from ember.configs import MidtrainConfigError
    from ember.midtrain.config import load_config
    from ember.midtrain.rl_config import load_rl_config

    try:
        return (load_rl_config if rl else load_config)(config)
    except MidtrainConfigError as exc:
        err.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(2)


@app.command()
def train(
    config: Path = typer.Argument(..., help="Run config YAML (see ember/midtrain/examples/)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Ranks on this machine (>1 runs torchrun)."),
) -> None:
    """Train in this process (one rank), or as N local ranks under torchrun; resumes from the latest checkpoint."""
    _load(config)
    if nproc_per_node > 1:
        args = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", "ember.midtrain.train", str(config),
        ]
        os.execv(sys.executable, args)
    from ember.midtrain.train import main

    raise typer.Exit(main([str(config)]))


@app.command()
def rl(config: Path = typer.Argument(..., help="RL config YAML (see ember/midtrain/examples/rl_tiny_cpu.yaml).")) -> None:
    """RL steps on rollout batches from Kafka in this process; resumes from the latest checkpoint."""
    _load(config, rl=True)
    from ember.midtrain.rl import main

    raise typer.Exit(main([str(config)]))


@app.command()
def launch(
    config: Path = typer.Argument(..., help="Run config YAML."),
    nodes: int = typer.Option(1, "--nodes", min=1),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", min=0, help="0: a CPU job (gloo)."),
    procs_per_node: int = typer.Option(
        None, "--procs-per-node", min=1, help="Ranks per node; default: --gpus-per-node, or 1 for a CPU job."
    ),
    partition: str = typer.Option("debug", "--partition"),
    time: str = typer.Option("01:00:00", "--time", help="Slurm time limit."),
    signal_seconds: int = typer.Option(120, "--signal-seconds", min=1, help="USR1 this long before the time limit."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the sbatch script; submit nothing."),
    mode: str = typer.Option("train", "--mode", help="train: mid-training; rl: the RL trainer on an RL config."),
) -> None:
    """Render the sbatch script for CONFIG, check data and partition, and submit it."""
    from ember.midtrain.data import DataError
    from ember.midtrain.launch import LaunchError, LaunchRequest, preflight, render_sbatch, submit

    if mode not in ("train", "rl"):
        err.print(f"[red]--mode must be train or rl, got {mode!r}[/red]", highlight=False)
        raise typer.Exit(2)
    cfg = _load(config, rl=True) if mode == "rl" else _load(config)
    request = LaunchRequest(
        config_path=config,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node or gpus_per_node or 1,
        partition=partition,
        time=time,
        signal_seconds=signal_seconds,
        mode=mode,
    )
    try:
        preflight(cfg, request, need_slurm=not dry_run)
        script = render_sbatch(cfg, request)
        if dry_run:
            typer.echo(script, nl=False)
            return
        job = submit(cfg, script)
    except (LaunchError, DataError) as exc:
        err.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(1)
    console.print(f"submitted job {job.job_id}", highlight=False)
    console.print(f"  script:      {job.script}", highlight=False)
    console.print(f"  slurm log:   {job.slurm_log}", highlight=False)
    console.print(f"  trainer log: {job.train_logs}", highlight=False)
    console.print(f"  metrics:     {job.metrics}", highlight=False)


@app.command()
def status(job_id: str = typer.Argument(...)) -> None:
    """State, restarts and log paths of a job, and the last step its trainer logged."""
    from ember.midtrain.launch import LaunchError, job_fields, job_logs

    try:
        fields = job_fields(job_id)
    except LaunchError as exc:
        err.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(1)
    for key in ("JobId", "JobName", "JobState", "Reason", "Restarts", "RunTime", "TimeLimit", "NodeList", "StdOut"):
        console.print(f"{key:>10}: {fields.get(key, '-')}", highlight=False)
    logs = job_logs(fields)
    for path in logs[1:]:
        console.print(f"{'trainer':>10}: {path}", highlight=False)
    lines = [l for p in logs[1:] if p.exists() for l in p.read_text(errors="replace").splitlines() if "] step " in l]
    if lines:
        console.print(f"{'last step':>10}: {lines[-1]}", highlight=False)


@app.command()
def logs(job_id: str = typer.Argument(...)) -> None:
    """Print the job's Slurm log and each restart's trainer log, oldest first."""
    from ember.midtrain.launch import LaunchError, job_fields, job_logs

    try:
        paths = job_logs(job_fields(job_id))
    except LaunchError as exc:
        err.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(1)
    for path in paths:
        typer.echo(f"==> {path} <==")
        typer.echo(path.read_text(errors="replace") if path.exists() else "(not written yet)")


if __name__ == "__main__":
    app()
