"""What mid-training and RL share at run time: the command line, megatron's known warnings, the
process group, threads, seeding, stop requests, the metrics log (JSON lines and TensorBoard events),
and the one place the megatron model, DDP wrapper and optimizer are built.

megatron-core is imported inside the functions: `main` installs the stop handler before the slow
imports, so an early preemption signal is never fatal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import re
import signal
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from ember.midtrain import cpu_compat
from ember.midtrain.config import MidtrainConfig, ParallelConfig, RLConfig

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# megatron-core 0.19's warnings that say nothing about this run, printed by every rank before the
# first step: (category, message regex, module regex). Each names the module it comes from, so a new
# warning, or one of these from elsewhere, still shows.
KNOWN_WARNINGS = [
    # A docstring's "\-" in inference/contexts/kv_block_allocator.py, reported when the .pyc is compiled
    # (the "module" of a compile-time warning is the source path).
    (SyntaxWarning, r"invalid escape sequence", r".*megatron[/\\]core[/\\]"),
    # megatron's own default cuda_graph_scope, raised on every TransformerConfig.
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config\Z"),
    # Imported with megatron.core.models; ember does not use MIMO.
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\.core\.models\.mimo\."),
]
# Only where there is no GPU: the Transformer Engine / Apex fallbacks are the CPU path, not a slowdown.
CPU_FALLBACK_WARNINGS = [
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to", r"megatron\.core\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\."),
]
# Deprecation notices megatron logs (not warns) about its own classes: logger name -> message regex.
KNOWN_LOG_WARNINGS = {
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED\.",
    "megatron.core.dist_checkpointing.strategies.torch": r"MCore's async save is deprecated",
}


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def silence_known_warnings() -> None:
    """Hides KNOWN_WARNINGS and KNOWN_LOG_WARNINGS (and the CPU fallbacks without a GPU); call before megatron loads."""
    known = KNOWN_WARNINGS + ([] if torch.cuda.is_available() else CPU_FALLBACK_WARNINGS)
    for category, message, module in known:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, message in KNOWN_LOG_WARNINGS.items():
        logging.getLogger(name).addFilter(_DropMessage(message))


def parse_entry_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    """`CONFIG [--threads N]`, the command line torchrun and the sbatch script give each rank."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("config")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per rank (overrides parallel.threads)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def with_threads(config: Any, threads: int | None) -> Any:
    """The config with parallel.threads set to `threads` (a --threads flag); unchanged for None."""
    if threads is None:
        return config
    return config.model_copy(update={"parallel": config.parallel.model_copy(update={"threads": threads})})


class StopRequest:
    """Remembers a SIGTERM/SIGUSR1 so the step in flight completes before the checkpoint."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._pid = os.getpid()

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != self._pid:  # a forked data-loader worker: the trainer decides
            return
        self.signal = signum
        print(f"[midtrain] received {signal.Signals(signum).name}: checkpointing after this step", flush=True)


# Per-sample bookkeeping in a metrics line, not a scalar to plot.
NOT_SCALARS = frozenset({"step", "sample_ids", "rows"})


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of a metrics line as TensorBoard tags: nested keys and list indices joined by "/"
    (source_loss/code, tokens_per_expert/1/3, mismatch/kl_mu_pi); strings, booleans and None are skipped."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if key in NOT_SCALARS or value is None or isinstance(value, (bool, str)):
            continue
        if isinstance(value, (int, float)):
            yield tag, float(value)
        elif isinstance(value, dict):
            yield from scalars(value, tag + "/")
        elif isinstance(value, list):
            yield from scalars({str(i): v for i, v in enumerate(value)}, tag + "/")


class MetricsLog:
    """One JSON line per step in metrics.jsonl (append mode: a resumed run continues the file) and the
    same scalars as TensorBoard event files beside it (`tensorboard --logdir` the run directory or its
    parent); a no-op off rank 0. Lines with an "event" key (a resume) are not steps and go to the file only.

    `first_step` is the step a resumed run logs next: TensorBoard then drops the earlier run's events from
    that step on, since the steps after the checkpoint are redone.
    """

    def __init__(self, path: Path, enabled: bool, first_step: int = 1):
        self.enabled = enabled
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)
            self._events = SummaryWriter(str(path.parent), purge_step=first_step if first_step > 1 else None, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if "event" not in record:
            for tag, value in scalars(record):
                self._events.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._events.close()
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(on_gpu: bool) -> None:
    """Joins the torchrun group, or makes a group of one for a plain single-process run."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=10))


def seed_everything(seed: int) -> None:
    """Python, numpy, torch and megatron's model-parallel RNGs; pipeline stages get distinct seeds."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def start(parallel: ParallelConfig, seed: int) -> bool:
    """Process group, CPU threads (parallel.threads; else torch's default, which follows
    OMP_NUM_THREADS), CPU patches, megatron's parallel state and seeds; returns whether the CPU
    patches are active (no GPU: gloo, fp32, no grad clipping)."""
    from megatron.core import parallel_state

    init_distributed(torch.cuda.is_available())
    if parallel.threads:
        torch.set_num_threads(parallel.threads)
        os.environ["OMP_NUM_THREADS"] = str(parallel.threads)  # data-loader workers and other children
    cpu_patched = cpu_compat.apply()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
    )
    seed_everything(seed)
    return cpu_patched


def shutdown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@dataclass
class ModelParts:
    """The model, its DDP wrapper (what the schedule runs and zeroes) and the megatron optimizer."""

    model: Any
    ddp: Any
    optimizer: Any


def build_model_and_optimizer(config: MidtrainConfig | RLConfig, *, bf16: bool, cpu_patched: bool) -> ModelParts:
    """GPTModel + DDP + megatron Adam from the model, moe and optimizer sections (RL configs have them too)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ember.midtrain.model import build_model, transformer_config

    tconfig = transformer_config(config, bf16=bf16)
    model = build_model(config, tconfig)
    ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), model)
    tconfig.finalize_model_grads_func = finalize_model_grads
    o = config.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=0.0 if cpu_patched else o.clip_grad,
            bf16=bf16,
            params_dtype=tconfig.params_dtype,
        ),
        [ddp],
    )
    return ModelParts(model, ddp, optimizer)


def set_learning_rate(optimizer: Any, weight_decay: float, lr_of_group: Callable[[dict], float]) -> float:
    """Sets each param group's lr (from the group: it may carry its own max/min lr) and weight decay
    (x the group's wd_mult); returns the last group's lr."""
    lr = 0.0
    for group in optimizer.param_groups:
        lr = lr_of_group(group)
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    return lr
