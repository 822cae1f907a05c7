"""`midtrain launch`: render an sbatch script for a validated config, check it can run, submit it.

Layout choice: one `srun` task per node, each running torchrun for that node's GPUs, with c10d
rendezvous on the first host of the allocation. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE per
worker and supervises a node's ranks; one task per GPU would need every rank's env
derived from SLURM_PROCID/SLURM_LOCALID by hand and gives no per-node supervisor. The per-node
torchrun ignores USR1 (`ember.midtrain.torchrun`); Slurm delivers it to the trainers directly.

Preemption: `--signal=B:USR1@<s> --requeue --open-mode=append`; the batch shell traps USR1,
forwards it (the trainer checkpoints and exits), then `scontrol requeue`s itself; on the next start
the trainer resumes from the latest checkpoint. Trainer logs are keyed by
`${SLURM_RESTART_COUNT:-0}`, the Slurm log appends across restarts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ember.midtrain.config import MidtrainConfig, RLConfig
from ember.midtrain.data import check_model_compatible, local_specs, open_manifests
from ember.midtrain.slurm import LaunchError, SlurmFailed, partition_resources

REPO_ROOT = Path(__file__).resolve().parents[2]


class _SbatchTemplate(Template):
    delimiter = "%%"  # bash and sbatch already use $ and single %


SBATCH_TEMPLATE = _SbatchTemplate(
    r"""#!/bin/bash
# Rendered by `midtrain launch` from %%{config}
#SBATCH --job-name=%%{job_name}
#SBATCH --nodes=%%{nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=%%{cpus_per_task}
%%{gpus_directive}
#SBATCH --partition=%%{partition}
#SBATCH --time=%%{time}
#SBATCH --output=%%{log_dir}/slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@%%{signal_seconds}
#SBATCH --requeue
set -uo pipefail

export PYTHONPATH=%%{pythonpath}${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=%%{threads}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1

RESTART=${SLURM_RESTART_COUNT:-0}
TRAIN_LOG="%%{log_dir}/train-${SLURM_JOB_ID}-${RESTART}.log"
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=$((29500 + SLURM_JOB_ID % 1000))
echo "[midtrain-launch] job $SLURM_JOB_ID restart $RESTART on $SLURM_JOB_NODELIST (rendezvous $HEAD:$PORT), trainer log $TRAIN_LOG"

# Preemption: Slurm sends USR1 to this shell %%{signal_seconds}s before the time limit (and
# `scancel --signal=USR1 --batch` does the same by hand). Forward it so the trainer finishes its
# step and checkpoints, wait for it, then requeue unless training already completed. TERM (scancel,
# scontrol requeue) is forwarded the same way but never requeued here: whoever sent it decides.
forward() {
  echo "[midtrain-launch] SIG$1: forwarding to the trainer (srun pid $TRAIN_PID)"
  kill -s "$1" "$TRAIN_PID" 2>/dev/null
  wait "$TRAIN_PID"
  if [[ "$1" == USR1 && ! -e "%%{complete_marker}" ]]; then
    echo "[midtrain-launch] requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 0
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  %%{python} -m ember.midtrain.torchrun \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node %%{procs_per_node} \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" \
    -m %%{module} %%{config} --threads %%{threads} >>"$TRAIN_LOG" 2>&1 &
TRAIN_PID=$!
wait "$TRAIN_PID"
status=$?
echo "[midtrain-launch] trainer exited with status $status"
exit $status
"""
)


@dataclass(frozen=True)
class LaunchRequest:
    config_path: Path
    nodes: int
    gpus_per_node: int
    procs_per_node: int
    partition: str
    time: str
    signal_seconds: int
    mode: str = "train"  # "rl": the RL trainer (`ember.midtrain.rl.run`) on an RLConfig
    threads: int | None = None  # CPU threads per rank; None: the config's parallel.threads, else the default


GPU_THREADS = 8
"""CPU threads per GPU rank when neither --threads nor parallel.threads says (data loading, host work)."""


def threads_per_rank(config: MidtrainConfig | RLConfig, request: LaunchRequest) -> int:
    """--threads, else the config's parallel.threads, else 1 per CPU rank or GPU_THREADS per GPU rank."""
    return request.threads or config.parallel.threads or (GPU_THREADS if request.gpus_per_node else 1)


def render_sbatch(config: MidtrainConfig | RLConfig, request: LaunchRequest) -> str:
    """The batch script text; a pure function of the config and the request."""
    gpus = f"#SBATCH --gpus-per-node={request.gpus_per_node}" if request.gpus_per_node else "# CPU job: no GPUs requested"
    threads = threads_per_rank(config, request)
    return SBATCH_TEMPLATE.substitute(
        config=str(request.config_path.resolve()),
        job_name=f"midtrain-{config.run_dir.name}",
        nodes=request.nodes,
        cpus_per_task=threads * request.procs_per_node,
        gpus_directive=gpus,
        partition=request.partition,
        time=request.time,
        log_dir=str(config.run_dir / "logs"),
        signal_seconds=request.signal_seconds,
        pythonpath=str(REPO_ROOT),
        threads=threads,
        complete_marker=str(config.complete_marker),
        python=sys.executable,
        procs_per_node=request.procs_per_node,
        module="ember.midtrain.rl.run" if request.mode == "rl" else "ember.midtrain.train",
    )


def _world_size_problems(config: MidtrainConfig, world: int) -> list[str]:
    p = config.parallel
    model_parallel = p.tensor * p.pipeline
    problems = []
    if world % model_parallel:
        problems.append(f"world size {world} is not a multiple of parallel.tensor x parallel.pipeline = {model_parallel}")
    else:
        dp = world // model_parallel
        if dp % p.expert:
            problems.append(f"data-parallel size {dp} is not a multiple of parallel.expert {p.expert}")
        if config.train.global_batch_size % (config.train.micro_batch_size * dp):
            problems.append(
                f"train.global_batch_size {config.train.global_batch_size} is not a multiple of "
                f"micro_batch_size {config.train.micro_batch_size} x data-parallel size {dp}"
            )
    return problems


def _rl_world_size_problems(config: RLConfig, world: int) -> list[str]:
    """RL ranks are all data-parallel (tensor = pipeline = 1, see RLConfig); experts split across `expert` of them."""
    if world % config.parallel.expert:
        return [f"world size {world} is not a multiple of parallel.expert {config.parallel.expert}"]
    return []


def check_data(config: MidtrainConfig) -> None:
    """Shard sets exist, are finished and complete, and were tokenized for this model."""
    specs = local_specs((s.path, s.weight) for s in config.data.shard_sets)
    check_model_compatible(
        specs,
        open_manifests(specs),
        vocab_size=config.model.vocab_size,
        seq_len=config.model.seq_len,
        tokenizer_name=config.model.tokenizer,
    )


def check_runnable(config: MidtrainConfig | RLConfig, world: int) -> None:
    """What a valid config can still get wrong for this run, checked before any process group or
    model exists: the layout for `world` ranks, the shard sets (mid-training) or the init checkpoint (RL).

    Raises LaunchError (layout, checkpoint) or DataError (shard sets), each naming what to fix.
    """
    if isinstance(config, RLConfig):
        problems = _rl_world_size_problems(config, world)
    else:
        problems = _world_size_problems(config, world)
    if problems:
        raise LaunchError("the requested layout cannot run this config: " + "; ".join(problems))
    if isinstance(config, RLConfig):
        init = config.init_checkpoint
        if init is not None and not (init / "metadata.json").is_file():
            raise LaunchError(
                f"init_checkpoint {init} is not a checkpoint ({'no metadata.json in it' if init.is_dir() else 'does not exist'}); "
                "name a step_* directory under a run's checkpoints/"
            )
    else:
        check_data(config)


def preflight(config: MidtrainConfig | RLConfig, request: LaunchRequest, *, need_slurm: bool) -> None:
    if request.gpus_per_node and request.procs_per_node != request.gpus_per_node:
        raise LaunchError(
            f"the requested layout cannot run this config: --procs-per-node {request.procs_per_node} "
            f"must equal --gpus-per-node {request.gpus_per_node}"
        )
    check_runnable(config, request.nodes * request.procs_per_node)
    if not need_slurm:
        return
    if shutil.which("sbatch") is None:
        raise SlurmFailed(
            "sbatch is not on PATH: run on a Slurm login node, or start the local cluster with "
            "`ember dev up --only slurm` (or use --dry-run to only print the script)"
        )
    nodes, gpus, cpus = partition_resources(request.partition)
    if request.nodes > nodes:
        raise LaunchError(f"--nodes {request.nodes}: partition {request.partition!r} has {nodes} node(s)")
    if request.gpus_per_node > gpus:
        raise LaunchError(
            f"--gpus-per-node {request.gpus_per_node}: partition {request.partition!r} has {gpus} GPU(s) per node"
            + ("; use --gpus-per-node 0 for a CPU run" if gpus == 0 else "")
        )
    threads = threads_per_rank(config, request)
    if threads * request.procs_per_node > cpus:
        raise LaunchError(
            f"{threads} thread(s) x {request.procs_per_node} rank(s) = {threads * request.procs_per_node} CPUs per node: "
            f"partition {request.partition!r} has {cpus}; lower --threads (or parallel.threads)"
        )


@dataclass(frozen=True)
class Submitted:
    job_id: str
    script: Path
    slurm_log: Path
    train_logs: str
    metrics: Path


def submit(config: MidtrainConfig, script_text: str) -> Submitted:
    logs = config.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    script = config.run_dir / "sbatch.sh"
    script.write_text(script_text)
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise SlurmFailed(f"sbatch refused the job: {result.stderr.strip() or result.stdout.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    return Submitted(
        job_id=job_id,
        script=script,
        slurm_log=logs / f"slurm-{job_id}.out",
        train_logs=str(logs / f"train-{job_id}-<restart>.log"),
        metrics=config.metrics_path,
    )
