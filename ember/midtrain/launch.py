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

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ember.midtrain.config import MidtrainConfig
from ember.midtrain.data import ShardSetSpec, check_model_compatible, open_manifests

REPO_ROOT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """Something the user must fix before the job can run; the message says what."""


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
export OMP_NUM_THREADS=%%{omp_threads}
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
    -m %%{module} %%{config} >>"$TRAIN_LOG" 2>&1 &
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
    mode: str = "train"  # "rl": the RL trainer (`ember.midtrain.rl`, one rank) on an RLConfig


def render_sbatch(config: MidtrainConfig, request: LaunchRequest) -> str:
    """The batch script text; a pure function of the config and the request."""
    gpus = f"#SBATCH --gpus-per-node={request.gpus_per_node}" if request.gpus_per_node else "# CPU job: no GPUs requested"
    return SBATCH_TEMPLATE.substitute(
        config=str(request.config_path.resolve()),
        job_name=f"midtrain-{config.run_dir.name}",
        nodes=request.nodes,
        cpus_per_task=request.procs_per_node if not request.gpus_per_node else 8 * request.gpus_per_node,
        gpus_directive=gpus,
        partition=request.partition,
        time=request.time,
        log_dir=str(config.run_dir / "logs"),
        signal_seconds=request.signal_seconds,
        pythonpath=str(REPO_ROOT),
        omp_threads=1 if not request.gpus_per_node else 8,
        complete_marker=str(config.complete_marker),
        python=sys.executable,
        procs_per_node=request.procs_per_node,
        module="ember.midtrain.rl" if request.mode == "rl" else "ember.midtrain.train",
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


def check_data(config: MidtrainConfig) -> None:
    """Shard sets exist, are finished and complete, and were tokenized for this model."""
    specs = [ShardSetSpec(s.path, s.weight) for s in config.data.shard_sets]
    check_model_compatible(
        specs,
        open_manifests(specs),
        vocab_size=config.model.vocab_size,
        seq_len=config.model.seq_len,
        tokenizer_name=config.model.tokenizer,
    )


def partition_resources(partition: str) -> tuple[int, int]:
    """(nodes, GPUs per node) of a partition, from sinfo; GPUs counted from its gres."""
    result = subprocess.run(
        ["sinfo", "-h", "-p", partition, "-o", "%D|%G"], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise LaunchError(f"sinfo failed for partition {partition!r}: {result.stderr.strip()}")
    lines = [l for l in result.stdout.splitlines() if l.strip()]
    if not lines:
        raise LaunchError(f"partition {partition!r} does not exist (sinfo lists none); see `sinfo -s`")
    nodes, gpus = 0, None
    for line in lines:
        count, gres = line.split("|", 1)
        nodes += int(count)
        found = [int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)]
        per_node = max(found) if found else 0
        gpus = per_node if gpus is None else max(gpus, per_node)
    return nodes, gpus or 0


def preflight(config: MidtrainConfig, request: LaunchRequest, *, need_slurm: bool) -> None:
    world = request.nodes * request.procs_per_node
    if request.mode == "rl":  # an RLConfig: one rank, batches come from Kafka (no shard sets to check)
        problems = [] if world == 1 else [f"the RL trainer runs as one rank, got {world} (use --nodes 1 --procs-per-node 1)"]
    else:
        problems = _world_size_problems(config, world)
    if request.gpus_per_node and request.procs_per_node != request.gpus_per_node:
        problems.append(f"--procs-per-node {request.procs_per_node} must equal --gpus-per-node {request.gpus_per_node}")
    if problems:
        raise LaunchError("the requested layout cannot run this config: " + "; ".join(problems))
    if request.mode != "rl":
        check_data(config)
    if not need_slurm:
        return
    if shutil.which("sbatch") is None:
        raise LaunchError(
            "sbatch is not on PATH: run on a Slurm login node, or start the local cluster with "
            "`ember dev up --only slurm` (or use --dry-run to only print the script)"
        )
    nodes, gpus = partition_resources(request.partition)
    if request.nodes > nodes:
        raise LaunchError(f"--nodes {request.nodes}: partition {request.partition!r} has {nodes} node(s)")
    if request.gpus_per_node > gpus:
        raise LaunchError(
            f"--gpus-per-node {request.gpus_per_node}: partition {request.partition!r} has {gpus} GPU(s) per node"
            + ("; use --gpus-per-node 0 for a CPU run" if gpus == 0 else "")
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
        raise LaunchError(f"sbatch refused the job: {result.stderr.strip() or result.stdout.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    return Submitted(
        job_id=job_id,
        script=script,
        slurm_log=logs / f"slurm-{job_id}.out",
        train_logs=str(logs / f"train-{job_id}-<restart>.log"),
        metrics=config.metrics_path,
    )


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (no slurmdbd: finished jobs stay visible for MinJobAge)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LaunchError(
            f"job {job_id} is not known to slurmctld ({result.stderr.strip()}); finished jobs are forgotten "
            "after MinJobAge: read the logs under the run directory's logs/ instead"
        )
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def job_logs(fields: dict[str, str]) -> list[Path]:
    """The Slurm log and every restart's trainer log of a job, oldest first."""
    slurm_log = Path(fields["StdOut"])
    job_id = fields["JobId"]
    restarts = sorted(
        slurm_log.parent.glob(f"train-{job_id}-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1])
    )
    return [slurm_log, *restarts]
