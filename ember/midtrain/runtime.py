"""What mid-training and RL share at run time: the process group, seeding, stop requests, the
metrics log, and the one place the megatron model, DDP wrapper and optimizer are built.

megatron-core is imported inside the functions: `main` installs the stop handler before the slow
imports, so an early preemption signal is never fatal.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ember.midtrain import cpu_compat
from ember.midtrain.config import MidtrainConfig, ParallelConfig
from ember.midtrain.rl_config import RLConfig

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


class MetricsLog:
    """Appends one JSON line per step (append mode: a resumed run continues the file); a no-op off rank 0."""

    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self._file.write(json.dumps(record) + "\n")


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
    """Process group, CPU patches, megatron's parallel state and seeds; returns whether the CPU
    patches are active (no GPU: gloo, fp32, no grad clipping)."""
    from megatron.core import parallel_state

    init_distributed(torch.cuda.is_available())
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
