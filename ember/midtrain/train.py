"""`midtrain train`: megatron-core MoE mid-training on ember shard sets, one process per rank.

Run directly for one process, or under torchrun for several (NCCL on GPUs, gloo on CPU). Every
step it logs loss, throughput, per-source loss, tokens per expert per layer and the global sample
ids it trained on (stdout and `run_dir/metrics.jsonl`). SIGTERM/SIGUSR1 finish the current step,
checkpoint and exit 0; the next start resumes from the latest checkpoint at the same global
sample position.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ember.midtrain import cpu_compat
from ember.midtrain.config import MidtrainConfig
from ember.midtrain.data import (
    GlobalOrderSampler,
    MidtrainDataset,
    ShardSetSpec,
    check_model_compatible,
    open_manifests,
    thd_cu_seqlens,
)
from ember.midtrain.sampling import num_microbatches
from ember.midtrain.schedule import wsd_lr

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Remembers a SIGTERM/SIGUSR1 so the step in flight completes before the checkpoint."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._pid = os.getpid()

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked data-loader worker: the trainer decides
            return
        self.signal = signum
        print(f"[midtrain] received {signal.Signals(signum).name}: checkpointing after this step", flush=True)


@dataclass
class StepAccumulator:
    """What one optimizer step saw on this rank, reduced across ranks for the metrics line."""

    num_sources: int
    num_layers: int
    num_experts: int
    sample_ids: list[int] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros(self.num_sources, dtype=torch.float64)
        self.tokens = torch.zeros(self.num_sources, dtype=torch.float64)
        self.expert_tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)


def _init_distributed(on_gpu: bool) -> None:
    if "RANK" not in os.environ:  # a plain `midtrain train`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=10))


def _seed(seed: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _apply_lr(optimizer, config: MidtrainConfig, step: int) -> float:
    """Sets lr (WSD, per group max/min lr) and weight decay (x the group's wd_mult) for update `step`."""
    lr = 0.0
    for group in optimizer.param_groups:
        lr = wsd_lr(
            step,
            lr=group.get("max_lr", config.optimizer.lr),
            min_lr=group.get("min_lr", config.optimizer.min_lr),
            total_steps=config.train.steps,
            warmup_steps=config.schedule.warmup_steps,
            decay_steps=config.schedule.decay_steps,
            decay_style=config.schedule.decay_style,
        )
        group["lr"] = lr
        group["weight_decay"] = config.optimizer.weight_decay * group.get("wd_mult", 1.0)
    return lr


def _count_routed_tokens(model, acc_ref: list[StepAccumulator]) -> None:
    """Forward hooks on every router: tokens routed to each expert, per (global) layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(module, inputs, output):
        routing_map = output[1]
        acc_ref[0].expert_tokens[module.layer_number - 1] += routing_map.sum(dim=0).detach().double().cpu()

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(hook)


class MetricsLog:
    """Rank 0 appends one JSON line per step (append mode: a resumed run continues the file)."""

    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if self.enabled:
            self._file.write(json.dumps(record) + "\n")


def train(config: MidtrainConfig, stop: StopRequest) -> int:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ember.midtrain import checkpoint
    from ember.midtrain.model import build_model, transformer_config, transformer_engine_usable

    on_gpu = torch.cuda.is_available()
    _init_distributed(on_gpu)
    cpu_patched = cpu_compat.apply()
    p = config.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline, expert_model_parallel_size=p.expert
    )
    _seed(config.train.seed)
    rank = dist.get_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    microbatches = num_microbatches(config.train.global_batch_size, config.train.micro_batch_size, dp_size)
    use_thd = transformer_engine_usable()
    bf16 = config.train.precision == "bf16" or (config.train.precision == "auto" and on_gpu)

    specs = [ShardSetSpec(s.path, s.weight) for s in config.data.shard_sets]
    manifests = open_manifests(specs)
    check_model_compatible(
        specs, manifests, vocab_size=config.model.vocab_size, seq_len=config.model.seq_len, tokenizer_name=config.model.tokenizer
    )
    total_samples = config.train.steps * config.train.global_batch_size
    dataset = MidtrainDataset(
        specs,
        num_samples=total_samples,
        seed=config.data.seed,
        blend_period=config.data.blend_period,
        window_chunks=config.data.shuffle_window_chunks,
        dense_attention_mask=not use_thd,
        manifests=manifests,
    )

    tconfig = transformer_config(config, bf16=bf16)
    model = build_model(config, tconfig)
    ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), model)
    tconfig.finalize_model_grads_func = finalize_model_grads
    clip_grad = 0.0 if cpu_patched else config.optimizer.clip_grad
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.optimizer.lr,
            min_lr=config.optimizer.min_lr,
            weight_decay=config.optimizer.weight_decay,
            adam_beta1=config.optimizer.adam_beta1,
            adam_beta2=config.optimizer.adam_beta2,
            adam_eps=config.optimizer.adam_eps,
            clip_grad=clip_grad,
            bf16=bf16,
            params_dtype=tconfig.params_dtype,
        ),
        [ddp],
    )

    checkpoint.start_writer_helper()
    state = checkpoint.TrainState()
    latest = checkpoint.latest_checkpoint(config.checkpoint_dir)
    if latest is not None:
        state, rng_restored = checkpoint.load(latest, model, optimizer, dataset.fingerprint)
        if not rng_restored:
            _seed(config.train.seed + state.step)
        if rank == 0:
            print(
                f"[midtrain] resumed from {latest} at step {state.step}, sample {state.consumed_samples} "
                f"(dp {dp_size}{'' if rng_restored else ', new parallel layout: RNG re-seeded'})",
                flush=True,
            )
    if rank == 0 and cpu_patched:
        print("[midtrain] no GPU: CPU compatibility patches active, gloo backend, fp32, grad clipping off", flush=True)

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=GlobalOrderSampler(
            state.consumed_samples, total_samples, config.train.micro_batch_size, dp_size, dp_rank
        ),
        num_workers=config.data.num_workers,
        pin_memory=on_gpu,
    )
    batches = iter(loader)
    acc_ref: list[StepAccumulator] = []
    _count_routed_tokens(model, acc_ref)
    forward_backward = get_forward_backward_func()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    seq_len = config.model.seq_len
    metrics = MetricsLog(config.metrics_path, enabled=rank == 0)
    is_last_stage = parallel_state.is_pipeline_last_stage()
    counts_metrics = is_last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
    counts_experts = parallel_state.get_tensor_model_parallel_rank() == 0
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def forward_step(data_iterator, model_chunk):
        acc = acc_ref[0]
        batch = next(data_iterator)
        acc.sample_ids.extend(batch["sample_id"].tolist())
        acc.rows.extend(torch.stack([batch["shard_set"], batch["epoch"], batch["row"]], dim=1).tolist())
        source_ids = batch["source_id"]
        loss_mask = batch["loss_mask"]
        inputs = {k: batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "position_ids")}
        if use_thd:  # the micro-batch as one token stream with every document boundary
            cu = thd_cu_seqlens(batch["cu_seqlens"], seq_len).to(device)
            max_len = int(batch["max_seqlen"].max())
            packed = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
            )
            inputs = {k: v.reshape(1, -1) for k, v in inputs.items()}
            output = model_chunk(inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"], packed_seq_params=packed)
        else:
            mask = batch["attention_mask"].to(device, non_blocking=True)
            output = model_chunk(inputs["tokens"], inputs["position_ids"], mask, labels=inputs["labels"])

        def loss_func(per_token_loss):
            mask = loss_mask.to(per_token_loss.device).reshape(per_token_loss.shape).float()
            masked = per_token_loss.float() * mask
            per_sample = masked.reshape(len(source_ids), -1).sum(dim=1).detach().double().cpu()
            tokens = mask.reshape(len(source_ids), -1).sum(dim=1).detach().double().cpu()
            acc.loss_sum.index_add_(0, source_ids, per_sample)
            acc.tokens.index_add_(0, source_ids, tokens)
            total = mask.sum()
            return masked.sum(), total.int(), {"lm loss": masked.sum().detach()}

        return output, loss_func

    start_step = state.step
    t_start = time.perf_counter()
    while state.step < config.train.steps:
        step = state.step + 1
        lr = _apply_lr(optimizer, config, step)
        acc_ref[:] = [StepAccumulator(len(dataset.source_names), config.model.num_layers, config.moe.num_experts)]
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[ddp],
            num_microbatches=microbatches,
            seq_length=seq_len,
            micro_batch_size=config.train.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        state.step = step
        state.consumed_samples += config.train.global_batch_size

        acc = acc_ref[0]
        n_src = len(dataset.source_names)
        vector = torch.cat(
            [
                acc.loss_sum if counts_metrics else torch.zeros(n_src, dtype=torch.float64),
                acc.tokens if counts_metrics else torch.zeros(n_src, dtype=torch.float64),
                (acc.expert_tokens if counts_experts else torch.zeros_like(acc.expert_tokens)).flatten(),
                torch.tensor([float(stop.signal is not None)], dtype=torch.float64),
            ]
        ).to(device)
        dist.all_reduce(vector)
        vector = vector.cpu()
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (dp_rank, acc.sample_ids, acc.rows))
        stop_now = bool(vector[-1] > 0)

        if rank == 0 and step % config.train.log_interval == 0:
            loss_sum, tokens = vector[:n_src], vector[n_src : 2 * n_src]
            per_dp = {d: (ids, rows) for d, ids, rows in seen}
            ids = [i for d in sorted(per_dp) for i in per_dp[d][0]]
            rows = [r for d in sorted(per_dp) for r in per_dp[d][1]]
            order = np.argsort(ids, kind="stable")
            experts = vector[2 * n_src : -1].reshape(config.model.num_layers, config.moe.num_experts)
            record = {
                "step": step,
                "loss": float(loss_sum.sum() / tokens.sum().clamp(min=1)),
                "source_loss": {
                    name: float(loss_sum[i] / tokens[i]) for i, name in enumerate(dataset.source_names) if tokens[i] > 0
                },
                "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": config.train.global_batch_size * seq_len / elapsed,
                "trained_tokens": int(tokens.sum()),
                "step_seconds": elapsed,
                "tokens_per_expert": experts.long().tolist(),
                "consumed_samples": state.consumed_samples,
                "sample_ids": [ids[i] for i in order],
                "rows": [rows[i] for i in order],
                "restart": restart,
                "dp_size": dp_size,
            }
            metrics.write(record)
            print(
                f"[midtrain] step {step}/{config.train.steps} loss {record['loss']:.4f} lr {lr:.2e} "
                f"{record['tokens_per_s']:.0f} tok/s experts/layer {record['tokens_per_expert']}",
                flush=True,
            )

        interval = config.train.save_interval
        if stop_now or state.step == config.train.steps or (interval and state.step % interval == 0):
            path = checkpoint.save(
                config.checkpoint_dir, model, optimizer, state, dataset.fingerprint, config.train.keep_checkpoints
            )
            if rank == 0:
                print(f"[midtrain] checkpoint {path} (step {state.step}, sample {state.consumed_samples})", flush=True)
        if stop_now:
            break

    if rank == 0:
        if state.step == config.train.steps:
            config.complete_marker.write_text(f"{state.step}\n")
        steps_run = state.step - start_step
        print(f"[midtrain] {'finished' if state.step == config.train.steps else 'stopped'} at step {state.step} "
              f"({steps_run} steps in {time.perf_counter() - t_start:.1f}s)", flush=True)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m ember.midtrain.train CONFIG` (what torchrun runs per rank)."""
    from ember.midtrain.config import load_config

    stop = StopRequest()
    stop.install()  # before the slow imports, so an early preemption signal is not fatal
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ember.midtrain.train CONFIG.yaml", file=sys.stderr)
        return 2
    return train(load_config(args[0]), stop)


if __name__ == "__main__":
    sys.exit(main())
