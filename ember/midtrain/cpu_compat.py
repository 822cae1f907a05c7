"""Lets megatron-core train on CPU (gloo) by replacing the few places where it hard-codes CUDA.

`apply()` does nothing when a GPU is present, so the same trainer runs unchanged with NCCL on GPUs.
Each patch below names the megatron-core (0.19) site it exists for; when a new megatron-core
release drops a hard-code, the matching patch should go too. Scope: what the CPU runs use, i.e.
pipeline size 1 (the pipelined schedules keep their own CUDA tensors), local layer spec, fp32,
non-distributed optimizer.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites a CUDA `device=` argument to CPU for the calls made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _on_cpu(function):
    """Wraps a megatron function that creates `device="cuda"` tensors so they land on CPU."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _CudaFactoriesOnCpu():
            return function(*args, **kwargs)

    return wrapper


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams (data-, model-, expert-parallel), kept as CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _dtoh_without_streams(self, point, tokens_per_expert=None):
    """CPU body of `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`: no streams or events,
    and the split sizes become numpy arrays exactly as the GPU path leaves them."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def apply() -> bool:
    """Installs the CPU patches once; returns True when they are active (no GPU present)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import token_dispatcher

    # Router buffers, DDP grad buffers and the loss scale are allocated on
    # `torch.cuda.current_device()` (moe/router.py, distributed/param_and_grad_buffer.py).
    torch.cuda.current_device = lambda: "cpu"

    # DDP's `start_grad_sync` asks for `torch.cuda.current_stream()` to wait on CUDA-graph events
    # (distributed/param_and_grad_buffer.py); the CPU stream has the same no-op interface.
    torch.cuda.current_stream = torch.cpu.current_stream

    # dist_checkpointing's `preload_tensors` (strategies/filesystem_async.py) waits on
    # `torch.cuda.synchronize()` after its device-to-host copies; on CPU there is nothing to wait for.
    torch.cuda.synchronize = lambda device=None: None

    # `model_parallel_cuda_manual_seed` and every `get_cuda_rng_tracker().fork()` (dropout, init)
    # read and write CUDA generator states; keep the same named streams on the CPU generator.
    mp_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    # The alltoall dispatcher creates a `torch.cuda.Stream()` in __init__ and copies split sizes
    # to the host on it; on CPU they are host tensors already.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no CUDA streams"
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_without_streams

    # `forward_backward_no_pipelining` counts tokens in `torch.zeros(..., device="cuda")`.
    schedules.forward_backward_no_pipelining = _on_cpu(schedules.forward_backward_no_pipelining)

    # `FP32Optimizer.__init__` keeps its loss scale in `torch.tensor([1.0], device="cuda")`.
    mcore_optimizer.FP32Optimizer.__init__ = _on_cpu(mcore_optimizer.FP32Optimizer.__init__)

    # Every optimizer step measures the grad norm in `torch.zeros(1, device="cuda")`
    # (optimizer/clip_grads.py). Clipping itself asserts CUDA grads, so CPU runs use clip_grad=0.
    mcore_optimizer.get_grad_norm_fp32 = _on_cpu(mcore_optimizer.get_grad_norm_fp32)

    _applied = True
    return True
