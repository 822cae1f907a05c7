"""The `midtrain` command line: train, RL, export a policy, launch on Slurm, job status and logs.

Imports stay light at module level: megatron-core loads only inside `train`, and this module is
what multiprocessing re-imports in dist_checkpointing's spawned helper process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from ember import terminal
from rich.markup import escape

app = typer.Typer(help="Megatron-core MoE mid-training on ember shard sets, locally or on Slurm.", no_args_is_help=True)
console = terminal.console(soft_wrap=True)
err = terminal.console(stderr=True, soft_wrap=True)  # paths in messages stay whole (no wrap at 80 columns)


def _error(message: object) -> None:
    """A message in red, its text printed as is (a "[midtrain]" or a list in it is not rich markup)."""
    err.print(f"[red]{escape(str(message))}[/red]", highlight=False)


def _load(config: Path, rl: bool = False):
    """The validated config, or its errors and exit code 2."""
    from ember.configs import MidtrainConfigError
    from ember.midtrain.config import load_config, load_rl_config

    try:
        return (load_rl_config if rl else load_config)(config)
    except MidtrainConfigError as exc:
        _error(exc)
        raise typer.Exit(2)


def _refused(exc: Exception) -> typer.Exit:
    """One line, and the exit code of the error's kind: 1 when Slurm itself failed or is missing, 2 when the
    config, an option, the data it names or a job id must change (as every ember command exits on usage errors)."""
    from ember.midtrain.slurm import SlurmFailed

    _error(exc)
    return typer.Exit(1 if isinstance(exc, SlurmFailed) else 2)


THREADS_HELP = "CPU threads per rank (torch and OMP_NUM_THREADS); default: parallel.threads"


def _check_runnable(cfg, world: int) -> None:
    """Layout, shard sets or init checkpoint, before any process group or megatron import: one line and
    exit 2, as `midtrain launch` and the rank entry points report them."""
    from ember.midtrain.data import DataError
    from ember.midtrain.launch import check_runnable
    from ember.midtrain.slurm import LaunchError

    try:
        check_runnable(cfg, world)
    except (LaunchError, DataError) as exc:
        raise _refused(exc) from None


@app.command()
def train(
    config: Path = typer.Argument(..., help="Run config YAML (see ember/midtrain/examples/)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Ranks on this machine (>1 runs torchrun)."),
    threads: int = typer.Option(None, "--threads", min=1, help=THREADS_HELP + "; else this machine's CPUs / ranks."),
) -> None:
    """Train in this process (one rank), or as N local ranks under torchrun; resumes from the latest checkpoint."""
    cfg = _load(config)
    _check_runnable(cfg, nproc_per_node)
    threads = threads or cfg.parallel.threads
    argv = [str(config), *(["--threads", str(threads)] if threads else [])]
    if nproc_per_node > 1:
        _exec_torchrun(nproc_per_node, threads, "ember.midtrain.train", argv)
    from ember.midtrain.train import main

    raise typer.Exit(main(argv))


@app.command()
def rl(
    config: Path = typer.Argument(..., help="RL config YAML (see ember/midtrain/examples/rl_tiny_cpu.yaml)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Ranks on this machine (>1 runs torchrun)."),
    max_restarts: int = typer.Option(
        0, "--max-restarts", min=0, help="With --nproc-per-node: restart every rank from the checkpoint this often when one dies."
    ),
    threads: int = typer.Option(None, "--threads", min=1, help=THREADS_HELP + "."),
) -> None:
    """RL steps on rollout batches from Kafka in this process, or as N local ranks under torchrun (each
    trains its share of every batch); resumes from the latest checkpoint."""
    cfg = _load(config, rl=True)
    _check_runnable(cfg, nproc_per_node)
    _check_batches_topic(cfg)
    threads = threads or cfg.parallel.threads
    argv = [str(config), *(["--threads", str(threads)] if threads else [])]
    if nproc_per_node > 1:
        _exec_torchrun(nproc_per_node, threads, "ember.midtrain.rl.run", argv, max_restarts)
    from ember.midtrain.rl.run import main

    raise typer.Exit(main(argv))


def _check_batches_topic(cfg) -> None:
    """The batches topic readable before any rank builds the model (seconds of imports and a model): a typo'd
    prefix or a missing ACL is one line and exit 2, not a traceback from every rank."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.transport import TopicUnavailable, consumer_config, topic_partitions

    bootstrap = cfg.rollouts.bootstrap or kafka_bootstrap()
    try:
        consumer = KafkaConsumer(**consumer_config(cfg.rollouts.security, group_id=None, bootstrap_servers=bootstrap))
        try:
            topic_partitions(consumer, cfg.rollouts.batches_topic, cfg.rollouts.security)
        finally:
            consumer.close()
    except TopicUnavailable as exc:
        _error(f"{exc}; the topics of a prefix are made by `ember rollouts topics create --prefix {cfg.rollouts.topic_prefix}`")
        raise typer.Exit(2)
    except KafkaError as exc:
        _error(f"Kafka at {bootstrap} did not answer ({exc}): is it running (`ember dev status`)?")
        raise typer.Exit(1)


def _exec_torchrun(nproc_per_node: int, threads: int | None, module: str, argv: list[str], max_restarts: int = 0) -> None:
    """Replaces this process with a standalone torchrun of `module` on `nproc_per_node` local ranks."""
    # torchrun would pin each rank to one thread (with a banner) when OMP_NUM_THREADS is unset
    shared = max(1, (os.cpu_count() or 1) // nproc_per_node)
    os.environ["OMP_NUM_THREADS"] = str(threads or os.environ.get("OMP_NUM_THREADS") or shared)
    # Each attempt's ranks meet in a store of their own: with the agent's shared store a restarted rank
    # can read a dead rank's address from the attempt before (pytorch/pytorch#135712).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", module, *argv,
    ]
    os.execv(sys.executable, args)


@app.command("export-hf")
def export_hf(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory (run_dir/checkpoints/step_*)."),
    out: Path = typer.Option(..., "--out", help="New directory for config.json, model.safetensors and export.json."),
    config: Path = typer.Option(
        None, "--config", help="The run config (mid-training or RL) whose model and moe sections the checkpoint was "
        "trained with; needed only for checkpoints that do not record them (mid-training ones)."
    ),
) -> None:
    """Write the checkpoint's policy as a Hugging Face MixtralForCausalLM directory (safetensors + config.json),
    atomically; prints the directory and its digest (the sha256 of export.json, which pins every file)."""
    import time

    from ember.configs import MidtrainConfigError
    from ember.midtrain import export_hf as export

    started = time.perf_counter()
    try:
        recorded = export.read_checkpoint_common(checkpoint).get("extra", {}).get("architecture")
        if config is not None:
            cfg = _load_any(config)
            model, moe = cfg.model, cfg.moe
            if recorded is not None and export.architecture_from_record(recorded) != (model, moe):
                raise export.ExportError(f"{config}'s model/moe sections differ from what {checkpoint} recorded")
        elif recorded is not None:
            model, moe = export.architecture_from_record(recorded)
        else:
            raise export.ExportError(f"{checkpoint} does not record its architecture: pass --config with its run config")
        done = export.export_checkpoint(checkpoint, out, model, moe)
    except (export.ExportError, MidtrainConfigError) as exc:
        raise _refused(exc) from None
    except OSError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    console.print(f"exported {done.path} in {time.perf_counter() - started:.2f}s", highlight=False, markup=False)
    console.print(f"  uri:    {done.uri}", highlight=False, markup=False)
    console.print(f"  sha256: {done.sha256} (export.json, which pins every file)", highlight=False, markup=False)


def _load_any(config: Path):
    """A mid-training or an RL config, whichever this file is (both carry model and moe)."""
    from ember.configs import MidtrainConfigError, read_yaml_mapping
    from ember.midtrain.config import load_config, load_rl_config

    data = read_yaml_mapping(config, MidtrainConfigError, sections="model, moe, ...")
    return (load_rl_config if "rl" in data else load_config)(config)


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
    threads: int = typer.Option(
        None, "--threads", min=1,
        help=THREADS_HELP + "; else 1 per CPU rank, 8 per GPU. Sets --cpus-per-task to this x ranks per node.",
    ),
) -> None:
    """Render the sbatch script for CONFIG, check data and partition, and submit it."""
    from ember.midtrain.data import DataError
    from ember.midtrain.launch import LaunchRequest, preflight, render_sbatch, submit
    from ember.midtrain.slurm import LaunchError

    if mode not in ("train", "rl"):
        _error(f"--mode must be train or rl, got {mode!r}")
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
        threads=threads,
    )
    try:
        preflight(cfg, request, need_slurm=not dry_run)
        script = render_sbatch(cfg, request)
        if dry_run:
            typer.echo(script, nl=False)
            return
        job = submit(cfg, script)
    except (LaunchError, DataError) as exc:
        raise _refused(exc) from None
    console.print(f"submitted job {job.job_id}", highlight=False, markup=False)
    console.print(f"  script:      {job.script}", highlight=False, markup=False)
    console.print(f"  slurm log:   {job.slurm_log}", highlight=False, markup=False)
    console.print(f"  trainer log: {job.train_logs}", highlight=False, markup=False)
    console.print(f"  metrics:     {job.metrics}", highlight=False, markup=False)


STATUS_KEYS = ("JobId", "JobName", "JobState", "Reason", "Restarts", "RunTime", "TimeLimit", "NodeList", "StdOut")


@app.command()
def status(
    job_ids: list[str] = typer.Argument(None, help="Job ids; default: every midtrain job slurmctld knows."),
) -> None:
    """State, restarts and log paths of jobs, and the last step each trainer logged (one scontrol call)."""
    from ember.midtrain.slurm import LaunchError, job_logs, jobs, last_line_with

    try:
        found = jobs(job_ids)
    except LaunchError as exc:
        raise _refused(exc) from None
    if not found:
        console.print("no midtrain jobs known to slurmctld (finished jobs are forgotten after MinJobAge)", highlight=False, markup=False)
    for i, fields in enumerate(found):
        if i:
            console.print()
        for key in STATUS_KEYS:
            console.print(f"{key:>10}: {fields.get(key, '-')}", highlight=False, markup=False)
        trainer_logs = job_logs(fields)[1:]
        for path in trainer_logs:
            console.print(f"{'trainer':>10}: {path}", highlight=False, markup=False)
        last = next((l for p in reversed(trainer_logs) if (l := last_line_with(p, "] step ")) is not None), None)
        if last:
            console.print(f"{'last step':>10}: {last}", highlight=False, markup=False)


@app.command()
def logs(
    job_id: str = typer.Argument(...),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing what the logs gain (a requeue's new trainer log too) until the job ends."
    ),
) -> None:
    """Print the job's Slurm log and each restart's trainer log, oldest first."""
    from ember.midtrain.slurm import LaunchError, LogFollower, job_fields, job_logs

    try:
        fields = job_fields(job_id)
    except LaunchError as exc:
        raise _refused(exc) from None
    if follow:
        try:
            state = LogFollower(fields, lambda text: typer.echo(text, nl=False)).follow()
        except KeyboardInterrupt:
            err.print(f"\nstopped following job {job_id} (the job keeps running)", highlight=False, markup=False)
            raise typer.Exit(130)
        err.print(f"job {job_id} ended: {state}", highlight=False, markup=False)
        return
    for path in job_logs(fields):
        typer.echo(f"==> {path} <==")
        typer.echo(path.read_text(errors="replace") if path.exists() else "(not written yet)")


@app.command()
def init(
    out: Path = typer.Argument(..., help="The config file to write (YAML)."),
    from_shards: list[str] = typer.Option(
        ..., "--from-shards", help="A shard-set directory or URL, optionally DIR=WEIGHT; repeat for a blend "
        "(weights default to each set's share of tokens)."
    ),
    template: Path = typer.Option(
        None, "--template", help="A config whose other sections (model size, moe, optimizer, train) are kept; "
        "default: ember/midtrain/examples/tiny_cpu.yaml."
    ),
    run_dir: str = typer.Option(None, "--run-dir", help="run_dir in the written config; default: runs/<OUT's name>."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
) -> None:
    """Write a training config that fits shard sets: tokenizer, vocabulary, seq_len and blend weights come from their
    manifests; the rest from the template. The written config is loaded and checked against the sets before exit."""
    import copy

    import yaml

    from ember.configs import MidtrainConfigError, read_yaml_mapping
    from ember.midtrain import init_config as fit
    from ember.midtrain.data import DataError, local_specs, open_manifests
    from ember.midtrain.launch import check_runnable
    from ember.midtrain.config import parse_config
    from ember.midtrain.slurm import LaunchError

    template = template or fit.TEMPLATE
    if out.exists() and not overwrite:
        _error(f"{out} exists; pass --overwrite to replace it")
        raise typer.Exit(2)
    try:
        choices = [fit.parse_choice(value) for value in from_shards]
        manifests = open_manifests(local_specs((c.location, 1.0) for c in choices))
        base = read_yaml_mapping(template, MidtrainConfigError, sections="model, moe, data, ...")
        config = fit.fitted_config(base, choices, manifests, out, run_dir)
    except (fit.InitError, DataError, MidtrainConfigError) as exc:
        _error(exc)
        raise typer.Exit(2)
    header = (
        f"# Written by `midtrain init` from {', '.join(from_shards)}.\n"
        f"# model.tokenizer, vocab_size, seq_len and data.shard_sets come from the manifests; the rest from {template}.\n"
    )
    try:
        check_runnable(parse_config(copy.deepcopy(config), out.resolve().parent, str(out)), 1)  # parsing resolves paths in place
    except (MidtrainConfigError, DataError, LaunchError) as exc:
        _error(f"the template {template} does not fit these shard sets: {exc}")
        raise typer.Exit(2)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(header + yaml.safe_dump(config, sort_keys=False))
    tmp.replace(out)
    model = config["model"]
    console.print(f"wrote {out}", highlight=False, markup=False)
    console.print(
        f"  tokenizer {model['tokenizer']}, vocab_size {model['vocab_size']:,}, seq_len {model['seq_len']:,}",
        highlight=False, markup=False,
    )
    for shard_set in config["data"]["shard_sets"]:
        console.print(f"  shard set {shard_set['path']} weight {shard_set['weight']}", highlight=False, markup=False)
    train = config["train"]
    console.print(
        f"  micro batch {train['micro_batch_size']} x {model['seq_len']:,} tokens, {train['steps']:,} steps (from the template)",
        highlight=False, markup=False,
    )
    console.print(f"next: midtrain train {out}", highlight=False, markup=False)


if __name__ == "__main__":
    app()
