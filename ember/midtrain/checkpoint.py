"""Checkpoints with megatron's `dist_checkpointing`: model, optimizer, schedule step, data
position and RNG states, one directory per step plus a `latest` pointer.

The pointer is replaced atomically only after every rank has finished writing, so a job killed
mid-save resumes from the previous complete checkpoint. Model and optimizer tensors are saved
sharded (global shapes), so a restart may change the data-parallel size; RNG states are per rank
and are restored only when the world size is unchanged (otherwise they are re-seeded from the step).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import random as mp_random

LATEST = "latest"
# Optimizer state keyed by parameter only (no `chained_<i>.` prefix), so a restart whose layout
# splits dense and expert optimizers differently still finds every tensor.
_OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0


def _layout() -> dict:
    return {
        "world_size": dist.get_world_size(),
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert": parallel_state.get_expert_model_parallel_world_size(),
    }


def _rng_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": mp_random.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    mp_random.get_cuda_rng_tracker().set_states(states["tracker"])


def _rng_sharded() -> ShardedObject:
    return ShardedObject("rng_state", _rng_states(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def start_writer_helper() -> None:
    """Starts dist_checkpointing's result-queue helper process now, with SIGUSR1/SIGTERM ignored.

    Why: Slurm signals every process of a job step. megatron spawns this helper lazily on the first
    save (`filesystem_async.get_write_results_queue`); spawned while our handlers are installed, it
    would start with default dispositions and die of the preemption signal in the middle of the
    very checkpoint that signal asked for. Ignored dispositions survive exec and fork, so it stays up.

    The helper is a multiprocessing Manager (a socket server; it never touches torch). Started by "spawn", megatron's
    default, it first re-imports the entry module (torch, megatron-core: ~6 CPU-s, tens of seconds on a loaded
    machine) and every rank waits for that; forked, it is ready in a fraction of a second. The trainers start it
    first, before the process group's sockets and any CUDA context exist, so the child inherits neither (a forked
    child holding a killed rank's sockets would hide its death from the other ranks); where CUDA is already
    initialised, megatron's spawn is kept.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        filesystem_async.get_write_results_queue(start_method)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist")
    return path


def save(
    root: Path, model, optimizer, state: TrainState, data_fingerprint: str, keep: int, extra: dict | None = None
) -> Path:
    """`extra`: small picklable state saved beside the train state (the RL trainer's reader position)."""
    path = root / f"step_{state.step:08d}"
    if dist.get_rank() == 0:
        if path.exists():  # an interrupted save of this same step: nothing points at it
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save(
        {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, metadata=_OPTIMIZER_METADATA),
            "rng": _rng_sharded(),
            "train": {"step": state.step, "consumed_samples": state.consumed_samples, "data_fingerprint": data_fingerprint},
            "layout": _layout(),
            "extra": extra or {},
        },
        str(path),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / LATEST)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return path


def load_extra(path: Path) -> dict:
    """The `extra` state a checkpoint was saved with ({} for checkpoints written without one)."""
    return dist_checkpointing.load_common_state_dict(str(path)).get("extra", {})


def load_model_weights(path: Path, model) -> None:
    """Only the model tensors of a checkpoint (a new run starting from another run's policy)."""
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(loaded["model"])


def load(path: Path, model, optimizer, data_fingerprint: str) -> tuple[TrainState, bool]:
    """Restores model and optimizer in place; returns the train state and whether RNG was restored."""
    common = dist_checkpointing.load_common_state_dict(str(path))
    if common["train"]["data_fingerprint"] != data_fingerprint:
        raise ValueError(
            f"{path} was trained on a different data order (fingerprint {common['train']['data_fingerprint']}, "
            f"now {data_fingerprint}): the shard sets, weights, seed or shuffle changed, so the saved "
            "position would not continue the same sequence. Start a new run_dir for a new data mix."
        )
    saved, now = common["layout"], _layout()
    changed = [k for k in ("tensor", "pipeline", "expert") if saved[k] != now[k]]
    if changed:
        raise ValueError(
            f"{path} was saved with parallel {', '.join(f'{k}={saved[k]}' for k in changed)}, this run uses "
            f"{', '.join(f'{k}={now[k]}' for k in changed)}: megatron splits the optimizer differently across "
            "those layouts. Resume with the saved tensor/pipeline/expert sizes (the data-parallel size may change)."
        )
    same_layout = saved == now
    model_sd = model.sharded_state_dict()
    request = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIMIZER_METADATA),
    }
    if same_layout:
        request["rng"] = _rng_sharded()
    loaded = dist_checkpointing.load(request, str(path))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    if same_layout:
        _set_rng_states(loaded["rng"])
    train = loaded["train"]
    return TrainState(step=train["step"], consumed_samples=train["consumed_samples"]), same_layout
