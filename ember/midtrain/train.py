"""`midtrain train`: megatron-core MoE mid-training on ember shard sets, one process per rank.

Run directly for one process, or under torchrun for several (NCCL on GPUs, gloo on CPU). Every
step it logs loss, throughput, per-source loss, tokens per expert per layer and the global sample
ids it trained on (stdout and `run_dir/metrics.jsonl`). SIGTERM/SIGUSR1 finish the current step,
checkpoint and exit 0; the next start resumes from the latest checkpoint at the same global
sample position.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from ember.configs import MidtrainConfigError
from ember.midtrain import runtime
from ember.midtrain.config import MidtrainConfig, load_config
from ember.midtrain.data import (
    DataError,
    GlobalOrderSampler,
    MidtrainDataset,
    check_model_compatible,
    local_specs,
    open_manifests,
    thd_cu_seqlens,
)
from ember.midtrain.launch import check_runnable
from ember.midtrain.runtime import MetricsLog, StopRequest
from ember.midtrain.slurm import LaunchError
from ember.midtrain.sampling import num_microbatches
from ember.midtrain.schedule import wsd_lr


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


@dataclass
class StepResult:
    """One finished optimizer step, before the cross-rank reduction."""

    step: int
    lr: float
    grad_norm: float | None
    seconds: float


@dataclass
class ReducedStep:
    """A step's accumulators summed over ranks, and whether any rank was asked to stop."""

    loss_sum: torch.Tensor  # [sources]
    tokens: torch.Tensor  # [sources]
    expert_tokens: torch.Tensor  # [layers, experts]
    seen: list[tuple[int, list[int], list[list[int]]]]  # per rank: (dp rank, sample ids, rows)
    stop: bool


class Trainer:
    """One rank of mid-training: model, optimizer, data loader and checkpoints, built from the config.

    A new Trainer resumes from the run's latest checkpoint when there is one; `train` runs steps until
    `train.steps` or a stop request, checkpointing on `save_interval`, at the end and on the signal.
    """

    def __init__(self, config: MidtrainConfig, stop: StopRequest):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from ember.midtrain import checkpoint
        from ember.midtrain.model import moe_routers, transformer_engine_usable

        self.config = config
        self.stop = stop
        self.on_gpu = torch.cuda.is_available()
        checkpoint.start_writer_helper()  # first: a forked helper must inherit no process-group sockets
        self.cpu_patched = runtime.start(config.parallel, config.train.seed)
        self.rank = dist.get_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.microbatches = num_microbatches(config.train.global_batch_size, config.train.micro_batch_size, self.dp_size)
        self.use_thd = transformer_engine_usable()
        bf16 = config.train.precision == "bf16" or (config.train.precision == "auto" and self.on_gpu)
        self.dataset = self._build_dataset()
        parts = runtime.build_model_and_optimizer(config, bf16=bf16, cpu_patched=self.cpu_patched)
        self.model, self.ddp, self.optimizer = parts.model, parts.ddp, parts.optimizer
        self.state = checkpoint.TrainState()
        latest = checkpoint.latest_checkpoint(config.checkpoint_dir)
        if latest is not None:
            self.load_checkpoint(latest)
        if self.rank == 0 and self.cpu_patched:
            print("[midtrain] no GPU: CPU compatibility patches active, gloo backend, fp32, grad clipping off", flush=True)
        self._batches = self._build_loader()
        self._acc = self._new_accumulator()
        for router in moe_routers(self.model):
            router.register_forward_hook(self._count_routed_tokens)
        self._forward_backward = get_forward_backward_func()
        self.device = runtime.compute_device()
        self.metrics = MetricsLog(config.metrics_path, enabled=self.rank == 0, first_step=self.state.step + 1)
        self.threads = torch.get_num_threads()
        if self.rank == 0:
            print(f"[midtrain] {dist.get_world_size()} rank(s), dp {self.dp_size}, {self.threads} CPU thread(s) per rank", flush=True)
        self.counts_experts = parallel_state.get_tensor_model_parallel_rank() == 0
        self.counts_metrics = parallel_state.is_pipeline_last_stage() and self.counts_experts
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def _build_dataset(self) -> MidtrainDataset:
        """The blended dataset, after checking the shard sets' manifests against the model."""
        config = self.config
        specs = local_specs((s.path, s.weight) for s in config.data.shard_sets)
        manifests = open_manifests(specs)
        check_model_compatible(
            specs, manifests, vocab_size=config.model.vocab_size, seq_len=config.model.seq_len,
            tokenizer_name=config.model.tokenizer,
        )
        return MidtrainDataset(
            specs,
            num_samples=config.train.steps * config.train.global_batch_size,
            seed=config.data.seed,
            blend_period=config.data.blend_period,
            window_chunks=config.data.shuffle_window_chunks,
            dense_attention_mask=not self.use_thd,
            cache_bytes=config.data.cache_mib * 2**20,
            manifests=manifests,
        )

    def _build_loader(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches of this data-parallel rank, from the consumed-samples position on."""
        config = self.config
        sampler = GlobalOrderSampler(
            self.state.consumed_samples, len(self.dataset), config.train.micro_batch_size, self.dp_size, self.dp_rank
        )
        self.dataset.read_ahead(sampler)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, num_workers=config.data.num_workers, pin_memory=self.on_gpu
        )
        return iter(loader)

    def _new_accumulator(self) -> StepAccumulator:
        return StepAccumulator(len(self.dataset.source_names), self.config.model.num_layers, self.config.moe.num_experts)

    def _count_routed_tokens(self, router: Any, inputs: Any, output: Any) -> None:
        """Forward hook on every router: tokens routed to each expert, per (global) layer."""
        routing_map = output[1]
        self._acc.expert_tokens[router.layer_number - 1] += routing_map.sum(dim=0).detach().double().cpu()

    def _scheduled_lr(self, step: int, group: dict) -> float:
        """WSD for update `step`, between the group's own max/min lr when it has them."""
        c = self.config
        return wsd_lr(
            step,
            lr=group.get("max_lr", c.optimizer.lr),
            min_lr=group.get("min_lr", c.optimizer.min_lr),
            total_steps=c.train.steps,
            warmup_steps=c.schedule.warmup_steps,
            decay_steps=c.schedule.decay_steps,
            decay_style=c.schedule.decay_style,
        )

    def _forward_step(self, data_iterator: Iterator[dict[str, torch.Tensor]], model_chunk: Any) -> tuple[Any, partial]:
        """megatron's forward step: one micro-batch through the model, packed (THD) when TE is usable."""
        from megatron.core.packed_seq_params import PackedSeqParams

        batch = next(data_iterator)
        self._acc.sample_ids.extend(batch["sample_id"].tolist())
        self._acc.rows.extend(torch.stack([batch["shard_set"], batch["epoch"], batch["row"]], dim=1).tolist())
        inputs = {k: batch[k].to(self.device, non_blocking=True) for k in ("tokens", "labels", "position_ids")}
        if self.use_thd:  # the micro-batch as one token stream with every document boundary
            cu = thd_cu_seqlens(batch["cu_seqlens"], self.config.model.seq_len).to(self.device)
            max_len = int(batch["max_seqlen"].max())
            packed = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
            )
            inputs = {k: v.reshape(1, -1) for k, v in inputs.items()}
            output = model_chunk(inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"], packed_seq_params=packed)
        else:
            mask = batch["attention_mask"].to(self.device, non_blocking=True)
            output = model_chunk(inputs["tokens"], inputs["position_ids"], mask, labels=inputs["labels"])
        return output, partial(self._loss, batch["loss_mask"], batch["source_id"])

    def _loss(self, loss_mask: torch.Tensor, source_ids: torch.Tensor, per_token_loss: torch.Tensor) -> tuple:
        """megatron's loss function: masked token loss, accumulated per source for the metrics line."""
        mask = loss_mask.to(per_token_loss.device).reshape(per_token_loss.shape).float()
        masked = per_token_loss.float() * mask
        per_sample = masked.reshape(len(source_ids), -1).sum(dim=1).detach().double().cpu()
        tokens = mask.reshape(len(source_ids), -1).sum(dim=1).detach().double().cpu()
        self._acc.loss_sum.index_add_(0, source_ids, per_sample)
        self._acc.tokens.index_add_(0, source_ids, tokens)
        return masked.sum(), mask.sum().int(), {"lm loss": masked.sum().detach()}

    def train_step(self) -> StepResult:
        """One optimizer step over this rank's share of the global batch."""
        config = self.config
        step = self.state.step + 1
        lr = runtime.set_learning_rate(self.optimizer, config.optimizer.weight_decay, partial(self._scheduled_lr, step))
        self._acc = self._new_accumulator()
        t0 = time.perf_counter()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self._batches,
            model=[self.ddp],
            num_microbatches=self.microbatches,
            seq_length=config.model.seq_len,
            micro_batch_size=config.train.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        if self.on_gpu:
            torch.cuda.synchronize()
        self.state.step = step
        self.state.consumed_samples += config.train.global_batch_size
        return StepResult(step, lr, float(grad_norm) if grad_norm is not None else None, time.perf_counter() - t0)

    def _reduce(self) -> ReducedStep:
        """Sums the step's accumulators over ranks (each counted once: last stage, TP rank 0) and gathers sample ids."""
        acc, n_src = self._acc, len(self.dataset.source_names)
        vector = torch.cat(
            [
                acc.loss_sum if self.counts_metrics else torch.zeros(n_src, dtype=torch.float64),
                acc.tokens if self.counts_metrics else torch.zeros(n_src, dtype=torch.float64),
                (acc.expert_tokens if self.counts_experts else torch.zeros_like(acc.expert_tokens)).flatten(),
                torch.tensor([float(self.stop.signal is not None)], dtype=torch.float64),
            ]
        ).to(self.device)
        dist.all_reduce(vector)
        vector = vector.cpu()
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (self.dp_rank, acc.sample_ids, acc.rows))
        experts = vector[2 * n_src : -1].reshape(self.config.model.num_layers, self.config.moe.num_experts)
        return ReducedStep(vector[:n_src], vector[n_src : 2 * n_src], experts, seen, bool(vector[-1] > 0))

    def _record(self, result: StepResult, reduced: ReducedStep) -> dict[str, Any]:
        """The step's metrics line; sample ids and rows in global order across data-parallel ranks."""
        config, loss_sum, tokens = self.config, reduced.loss_sum, reduced.tokens
        per_dp = {d: (ids, rows) for d, ids, rows in reduced.seen}
        ids = [i for d in sorted(per_dp) for i in per_dp[d][0]]
        rows = [r for d in sorted(per_dp) for r in per_dp[d][1]]
        order = np.argsort(ids, kind="stable")
        return {
            "step": result.step,
            "loss": float(loss_sum.sum() / tokens.sum().clamp(min=1)),
            "source_loss": {
                name: float(loss_sum[i] / tokens[i]) for i, name in enumerate(self.dataset.source_names) if tokens[i] > 0
            },
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": config.train.global_batch_size * config.model.seq_len / result.seconds,
            "trained_tokens": int(tokens.sum()),
            "step_seconds": result.seconds,
            "tokens_per_expert": reduced.expert_tokens.long().tolist(),
            "consumed_samples": self.state.consumed_samples,
            "sample_ids": [ids[i] for i in order],
            "rows": [rows[i] for i in order],
            "restart": self.restart,
            "dp_size": self.dp_size,
            "threads": self.threads,
        }

    def _log(self, result: StepResult, reduced: ReducedStep) -> None:
        record = self._record(result, reduced)
        self.metrics.write(record)
        print(
            f"[midtrain] step {result.step}/{self.config.train.steps} loss {record['loss']:.4f} lr {result.lr:.2e} "
            f"{record['tokens_per_s']:.0f} tok/s experts/layer {record['tokens_per_expert']}",
            flush=True,
        )

    def train(self) -> None:
        """Steps until `train.steps` or a stop request (any rank's), then the final checkpoint."""
        steps, interval = self.config.train.steps, self.config.train.save_interval
        start_step, t_start = self.state.step, time.perf_counter()
        while self.state.step < steps:
            result = self.train_step()
            reduced = self._reduce()
            if self.rank == 0 and result.step % self.config.train.log_interval == 0:
                self._log(result, reduced)
            if reduced.stop or result.step == steps or (interval and result.step % interval == 0):
                self.save_checkpoint()
            if reduced.stop:
                break
        if self.rank == 0:
            done = self.state.step == steps
            if done:
                self.config.complete_marker.write_text(f"{self.state.step}\n")
            print(f"[midtrain] {'finished' if done else 'stopped'} at step {self.state.step} "
                  f"({self.state.step - start_step} steps in {time.perf_counter() - t_start:.1f}s)", flush=True)

    def save_checkpoint(self) -> Path:
        from ember.midtrain import checkpoint

        path = checkpoint.save(
            self.config.checkpoint_dir, self.model, self.optimizer, self.state, self.dataset.fingerprint,
            self.config.train.keep_checkpoints,
        )
        if self.rank == 0:
            print(f"[midtrain] checkpoint {path} (step {self.state.step}, sample {self.state.consumed_samples})", flush=True)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Model, optimizer, step and sample position; RNG too unless the parallel layout changed (then re-seeded)."""
        from ember.midtrain import checkpoint

        self.state, rng_restored = checkpoint.load(path, self.model, self.optimizer, self.dataset.fingerprint)
        if not rng_restored:
            runtime.seed_everything(self.config.train.seed + self.state.step)
        if self.rank == 0:
            print(
                f"[midtrain] resumed from {path} at step {self.state.step}, sample {self.state.consumed_samples} "
                f"(dp {self.dp_size}{'' if rng_restored else ', new parallel layout: RNG re-seeded'})",
                flush=True,
            )

    def close(self) -> None:
        self.metrics.close()
        dist.barrier()
        runtime.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m ember.midtrain.train CONFIG [--threads N]` (what torchrun runs per rank).

    The config, layout and shard sets are checked before the process group or megatron exist, so a
    mistake is one line on stderr and exit 2, not a traceback per rank.
    """
    stop = StopRequest()
    stop.install()  # before the slow imports, so an early preemption signal is not fatal
    runtime.silence_known_warnings()
    args = runtime.parse_entry_args("python -m ember.midtrain.train", sys.argv[1:] if argv is None else argv)
    try:
        config = runtime.with_threads(load_config(args.config), args.threads)
        check_runnable(config, int(os.environ.get("WORLD_SIZE", "1")))
    except (MidtrainConfigError, LaunchError, DataError) as exc:
        print(f"[midtrain] {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        trainer = Trainer(config, stop)
        trainer.train()
    except DataError as exc:  # a corrupt, missing or changed shard: every rank names it and stops, no traceback
        print(f"[midtrain] {exc}", file=sys.stderr, flush=True)
        return 2
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
