"""`midtrain rl CONFIG`: the megatron-core MoE policy trained on rollout batches from Kafka.

Per batch (a `TrainBatch` from `RolloutBatchReader`): the trainer's per-token log-probs, with the
sampler's routed experts forced through megatron-core router replay when configured; the
train/inference mismatch measured (|delta logp|, KL(mu||pi), routing disagreement) and corrected
(TIS, MIS or sequence-level geometric masking); a PPO clipped policy-gradient loss on the batch's
advantages, masked to policy tokens; an optimizer step; then the reader commits, the new policy
version is announced on `<prefix>.policy-versions`, and every `save_interval` steps a checkpoint
holding the reader position is written. A restart resumes on the batch after the checkpoint.
SIGTERM/SIGUSR1 finish the step, checkpoint and exit 0. One JSON line per step in metrics.jsonl;
a restart appends {"event": "resumed", "step": S}: lines of steps after S before it were redone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ember.midtrain import cpu_compat, rl_math
from ember.midtrain.rl_config import RLConfig
from ember.midtrain.model import moe_routers
from ember.midtrain.train import MetricsLog, StopRequest, _init_distributed, _seed

# How often the idle trainer wakes up to notice a stop signal or its idle timeout.
_POLL_S = 1.0


def policy_model_config(config: RLConfig) -> RLConfig:
    """The config the model is built from: megatron's routing replay on exactly when rl.replay is."""
    return config.model_copy(update={"moe": config.moe.model_copy(update={"routing_replay": config.rl.replay == "replay"})})


@dataclass
class _Inputs:
    tokens: torch.Tensor  # [T] int64
    labels: torch.Tensor
    positions: torch.Tensor
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, True = masked
    cu_seqlens: torch.Tensor
    mask: torch.Tensor  # [T] float, policy tokens with a log-prob
    advantages: torch.Tensor
    sampler_logp: torch.Tensor
    replay: list[torch.Tensor] | None  # per MoE layer [T, top_k] int64, layer order


class RLTrainer:
    """Model, optimizer and one RL step; `run_rl` feeds it batches. One rank (see RLConfig)."""

    def __init__(self, config: RLConfig):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from ember.midtrain import checkpoint
        from ember.midtrain.model import build_model, transformer_config

        self.config = config
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        _init_distributed(on_gpu)
        if dist.get_world_size() != 1:
            raise ValueError(f"the RL trainer runs as one rank, got world size {dist.get_world_size()}")
        cpu_patched = cpu_compat.apply()
        parallel_state.initialize_model_parallel()
        _seed(config.rl.seed)
        model_config = policy_model_config(config)
        self.tconfig = transformer_config(model_config, bf16=False)
        self.model = build_model(model_config, self.tconfig)
        self.ddp = DistributedDataParallel(self.tconfig, DistributedDataParallelConfig(), self.model)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        o = config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=0.0 if cpu_patched else o.clip_grad,
                params_dtype=self.tconfig.params_dtype,
            ),
            [self.ddp],
        )
        for group in self.optimizer.param_groups:  # constant lr: RL runs as long as rollouts come
            group["lr"] = o.lr
            group["weight_decay"] = o.weight_decay * group.get("wd_mult", 1.0)
        self.routers = moe_routers(self.model)
        self._maps: list[torch.Tensor] | None = None
        for router in self.routers:
            router.register_forward_hook(self._capture_routing)

        checkpoint.start_writer_helper()
        self.state = checkpoint.TrainState()
        self.reader_state: dict | None = None
        self.resumed_from = checkpoint.latest_checkpoint(config.checkpoint_dir)
        if self.resumed_from is not None:
            self.state, _ = checkpoint.load(self.resumed_from, self.model, self.optimizer, config.rollouts.batches_topic)
            self.reader_state = checkpoint.load_extra(self.resumed_from).get("reader")
        elif config.init_checkpoint is not None:
            checkpoint.load_model_weights(config.init_checkpoint, self.model)
        self.cpu_patched = cpu_patched

    @property
    def policy_version(self) -> int:
        return self.config.rl.initial_policy_version + self.state.step

    def _capture_routing(self, module, inputs, output) -> None:
        if self._maps is not None:
            self._maps.append(output[1].detach())

    def _inputs(self, tensors: dict) -> _Inputs:
        t = {k: v.to(self.device) for k, v in tensors.items()}
        cu = t["cu_seqlens"]
        replay = None
        experts = t.get("routed_experts")
        if self.config.rl.replay == "replay" and experts is not None:
            layers, top_k = experts.shape[1], experts.shape[2]
            if (layers, top_k) != (len(self.routers), self.config.moe.router_topk):
                raise ValueError(
                    f"the batch's routed experts are [T, {layers}, {top_k}], the model has {len(self.routers)} MoE "
                    f"layers with top-{self.config.moe.router_topk}: the rollouts came from another model"
                )
            if int(experts.max()) >= self.config.moe.num_experts:
                raise ValueError(f"routed expert id {int(experts.max())} >= moe.num_experts {self.config.moe.num_experts}")
            if rl_math.repeats_an_expert(experts):
                raise ValueError("the batch's routed experts repeat an expert within a token's top-k: not a router's output")
            replay = [experts[:, layer, :].long() for layer in range(layers)]
        if int(t["tokens"].max()) >= self.model.vocab_size:
            raise ValueError(f"token id {int(t['tokens'].max())} is outside the model's {self.model.vocab_size}-row vocabulary")
        return _Inputs(
            tokens=t["tokens"],
            labels=rl_math.next_token_labels(t["tokens"], cu),
            positions=t["position_ids"],
            attention_mask=rl_math.block_diagonal_causal_mask(cu),
            cu_seqlens=cu,
            mask=rl_math.trainable_mask(t["loss_mask"], cu),
            advantages=t["advantages"].float(),
            sampler_logp=t["sampler_logprobs"].float(),
            replay=replay,
        )

    def _set_replay(self, action, indices: list[torch.Tensor] | None = None) -> None:
        for layer, router in enumerate(self.routers):
            if indices is not None:
                router.router_replay.clear_indices()
                router.router_replay.set_target_indices(indices[layer])
            router.router_replay.set_router_replay_action(action)

    def _clear_replay(self) -> None:
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def _forward_backward(self, inputs: _Inputs, loss_fn) -> None:
        """One forward + backward through megatron's schedule; `loss_fn(token_logp)` -> scalar loss.

        With replay the routers take the sampler's indices in the forward (REPLAY_FORWARD) and the
        same ones if activation recompute re-runs the router during backward (REPLAY_BACKWARD); the
        router's own scores are gathered at those indices, so the router still gets gradients.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def forward_step(data_iterator, model_chunk):
            next(data_iterator)
            if inputs.replay is not None:
                self._set_replay(RouterReplayAction.REPLAY_FORWARD, inputs.replay)
            output = model_chunk(
                inputs.tokens[None], inputs.positions[None], inputs.attention_mask, labels=inputs.labels[None]
            )

            def loss_func(per_token_loss):
                if inputs.replay is not None:
                    self._set_replay(RouterReplayAction.REPLAY_BACKWARD)
                token_logp = rl_math.token_logprobs(-per_token_loss[0].float(), inputs.cu_seqlens)
                loss = loss_fn(token_logp)
                return loss, torch.tensor(1, dtype=torch.int), {"rl loss": loss.detach()}

            return output, loss_func

        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([None]),
                model=[self.ddp],
                num_microbatches=1,
                seq_length=len(inputs.tokens),
                micro_batch_size=1,
                forward_only=False,
            )
        finally:
            if inputs.replay is not None:
                self._clear_replay()

    def train_step(self, batch, tensors: dict) -> dict:
        """Trains on one TrainBatch (`updates_per_batch` optimizer updates); returns its metrics line."""
        rl = self.config.rl
        started = time.perf_counter()
        inputs = self._inputs(tensors)
        first: dict = {}
        losses = []

        def loss_fn(logp: torch.Tensor) -> torch.Tensor:
            if not first:  # the policy before this batch's updates: pi_old, for rho and "recompute"
                first["logp"] = logp.detach()
                log_rho = first["logp"] - inputs.sampler_logp
                first["weights"] = rl_math.correction_weights(
                    rl.correction, log_rho, inputs.mask, inputs.cu_seqlens, cap=rl.tis_cap, alpha=rl.alpha, beta=rl.beta
                )
            old = inputs.sampler_logp if rl.old_policy == "sampler" else first["logp"]
            per_token, clipped = rl_math.ppo_clipped_loss(logp, old, inputs.advantages, rl.clip_low, rl.clip_high)
            first.setdefault("clip_frac", float((clipped * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)))
            loss = rl_math.aggregate(per_token * first["weights"], inputs.mask, inputs.cu_seqlens, rl.aggregation)
            losses.append(float(loss.detach()))
            return loss

        forward_s = 0.0
        for update in range(rl.updates_per_batch):
            self._maps = [] if update == 0 else None
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            t0 = time.perf_counter()
            self._forward_backward(inputs, loss_fn)
            forward_s += time.perf_counter() - t0
            self.optimizer.step()
        maps, self._maps = self._maps, None
        self.state.step += 1
        self.state.consumed_samples += batch.num_sequences

        record = {
            "step": self.state.step,
            "batch_id": batch.batch_id,
            "batch_step": batch.step,
            "sequences": batch.num_sequences,
            "tokens": int(len(inputs.tokens)),
            "policy_tokens": int(inputs.mask.sum()),
            "loss": losses[0],
            "loss_last_update": losses[-1],
            "clip_frac": first["clip_frac"],
            "correction": rl.correction,
            "correction_mean_weight": float((first["weights"] * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)),
            "correction_kept_frac": float(((first["weights"] > 0).float() * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)),
            "mismatch": rl_math.mismatch_metrics(first["logp"], inputs.sampler_logp, inputs.mask, rl.alpha, rl.beta),
            "replayed": inputs.replay is not None,
            "policy_version": self.policy_version,
            "max_policy_lag": int(self.policy_version - 1 - int(np.min(batch.policy_versions))),
            "step_seconds": time.perf_counter() - started,
            "forward_backward_seconds": forward_s,
        }
        experts = tensors.get("routed_experts")
        if experts is not None:
            per_layer = [rl_math.routing_disagreement(m.cpu(), experts[:, layer, :]) for layer, m in enumerate(maps)]
            record["routing_disagreement"] = float(np.mean(per_layer))
            record["routing_disagreement_per_layer"] = per_layer
        return record

    def save(self, reader_state: dict) -> Path:
        from ember.midtrain import checkpoint

        return checkpoint.save(
            self.config.checkpoint_dir, self.model, self.optimizer, self.state, self.config.rollouts.batches_topic,
            self.config.rl.keep_checkpoints, extra={"reader": reader_state},
        )

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class PolicyVersionPublisher:
    """Announces each new policy version, in the encoding the ETL's PolicyWatcher reads."""

    def __init__(self, prefix: str, bootstrap: str):
        from kafka import KafkaProducer

        from ember.rollouts.topics import default_topics
        from ember.rollouts.admin import ensure_topics
        from ember.rollouts.transport import producer_config

        spec = default_topics(prefix)["policy_versions"]
        ensure_topics(bootstrap, [spec])
        self.topic = spec.name
        self.producer = KafkaProducer(**producer_config(bootstrap_servers=bootstrap))

    def publish(self, version: int) -> None:
        from ember.rollouts.records import PolicyVersion

        self.producer.send(self.topic, key=b"policy", value=PolicyVersion.now(version).encode()).get(timeout=30)

    def close(self) -> None:
        self.producer.close()


def run_rl(config: RLConfig, stop: StopRequest) -> int:
    from ember.rollouts.reader import RolloutBatchReader
    from ember.rollouts.transport import kafka_bootstrap

    trainer = RLTrainer(config)
    bootstrap = config.rollouts.bootstrap or kafka_bootstrap()
    rl = config.rl
    metrics = MetricsLog(config.metrics_path, enabled=True)
    if trainer.resumed_from is not None:
        metrics.write({"event": "resumed", "step": trainer.state.step, "checkpoint": str(trainer.resumed_from)})
        print(f"[rl] resumed from {trainer.resumed_from} at step {trainer.state.step}", flush=True)
    if trainer.cpu_patched:
        print("[rl] no GPU: CPU compatibility patches active, gloo backend, fp32, grad clipping off", flush=True)
    publisher = PolicyVersionPublisher(config.rollouts.topic_prefix, bootstrap)
    reader = RolloutBatchReader(
        config.rollouts.batches_topic, group_id=config.rollouts.group_id, state=trainer.reader_state,
        bootstrap=bootstrap, idle_timeout_s=_POLL_S,
    )
    saved_step = trainer.state.step if trainer.resumed_from is not None else None
    idle_since = time.monotonic()
    try:
        while trainer.state.step < rl.steps and stop.signal is None:
            try:
                read = next(reader)
            except StopIteration:
                idle = config.rollouts.idle_timeout_s
                if idle is not None and time.monotonic() - idle_since > idle:
                    print(f"[rl] no batch for {idle:.0f}s: stopping at step {trainer.state.step}", flush=True)
                    break
                continue
            record = trainer.train_step(read.batch, read.tensors)
            record["offset"] = read.offset
            reader.commit()
            if rl.save_interval and trainer.state.step % rl.save_interval == 0:
                trainer.save(reader.state_dict())
                saved_step = trainer.state.step
            metrics.write(record)
            publisher.publish(trainer.policy_version)
            m = record["mismatch"]
            print(
                f"[rl] step {record['step']}/{rl.steps} batch {record['batch_id']} loss {record['loss']:.4f} "
                f"|dlogp| {m['mean_abs_delta_logp']:.4f} kl {m['kl_mu_pi']:.2e} outside {m['frac_outside']:.3f} "
                f"routing-disagree {record.get('routing_disagreement', float('nan')):.3f} {record['step_seconds']:.2f}s",
                flush=True,
            )
            idle_since = time.monotonic()
        if saved_step != trainer.state.step:
            trainer.save(reader.state_dict())
        if trainer.state.step >= rl.steps:
            config.complete_marker.write_text(f"{trainer.state.step}\n")
        print(f"[rl] {'finished' if trainer.state.step >= rl.steps else 'stopped'} at step {trainer.state.step}", flush=True)
    finally:
        reader.close()
        publisher.close()
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m ember.midtrain.rl CONFIG`."""
    from ember.midtrain.rl_config import load_rl_config

    stop = StopRequest()
    stop.install()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ember.midtrain.rl CONFIG.yaml", file=sys.stderr)
        return 2
    return run_rl(load_rl_config(args[0]), stop)


if __name__ == "__main__":
    sys.exit(main())
