"""The RL trainer: the megatron-core MoE policy trained one `RLBatch` at a time, and its run loop.

Per batch: the trainer's per-token log-probs, with the sampler's routed experts forced through
megatron-core router replay when configured, the rollouts of the packed row kept apart as the built
attention honours it (THD packed-sequence parameters on Transformer Engine, the dense block-diagonal
mask on the local spec, see `model.packed_attention`); the train/inference mismatch measured (|delta logp|,
KL(mu||pi), routing disagreement) and corrected (TIS, MIS or sequence-level geometric masking); a PPO
clipped policy-gradient loss on the batch's advantages, masked to policy tokens; an optimizer step.

The trainer never owns the transport: `run_rl` takes an iterable of batches and a `PolicyChannel`
told of every finished step and of every announced policy version (Kafka in `midtrain rl`, lists in
the tests and benchmarks). A version is announced only once it is checkpointed and exported
(`rl.publish`: full or a delta on the last version, durable, hashed, uploaded with
`rl.publish_uri`): the announcement carries the export's URI and sha256. A
checkpoint holds the transport position of the last trained batch, so a restart resumes on the
batch after it. One JSON line per step in metrics.jsonl; a restart appends
{"event": "resumed", "step": S}: lines of steps after S before it were redone.

Several ranks (data-parallel, experts split over `parallel.expert` of them) each train their share
of every batch (`ember.midtrain.rl.ranks`); the loss is aggregated over the whole batch, so a step on
N ranks is the step one rank would take on the same batch, and the metrics line is the whole batch's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ember.midtrain import runtime
from ember.midtrain.rl import step_math
from ember.midtrain.model import moe_routers, packed_attention
from ember.midtrain.rl.batch import RLBatch, RolloutSource, attention_inputs
from ember.midtrain.config import RLConfig, RLSettings
from ember.midtrain.rl.ranks import BatchMessage, RankBatches
from ember.midtrain.runtime import MetricsLog, StopRequest
from ember.rollouts.faults import crash_point
from ember.rollouts.records import PolicyVersion
from ember.schemas.rollouts import SINGLE_SAMPLE_ESTIMATOR_PREFIX

_EXTREMES = ("max_abs_delta_logp", "rho_max", "rho_min")
"""Mismatch metrics reduced over ranks by max (min), not averaged by token."""


class PolicyChannel(Protocol):
    """Where `run_rl` reports: every finished step (the transport commits its read position) and every
    announced policy version (its weights already durable where the record's URI points)."""

    def step_done(self) -> None: ...

    def announce(self, version: PolicyVersion) -> None: ...


def policy_model_config(config: RLConfig) -> RLConfig:
    """The config the model is built from: megatron's routing replay on exactly when rl.replay is."""
    return config.model_copy(update={"moe": config.moe.model_copy(update={"routing_replay": config.rl.replay == "replay"})})


@dataclass
class _Inputs:
    tokens: torch.Tensor  # [T] int64
    labels: torch.Tensor
    positions: torch.Tensor
    attention_mask: torch.Tensor | None  # [1, 1, T, T] bool, True = masked; local attention only
    packed: Any  # megatron PackedSeqParams (THD) for Transformer Engine attention, else None
    cu_seqlens: torch.Tensor
    mask: torch.Tensor  # [T] float, policy tokens with a log-prob
    advantages: torch.Tensor
    sampler_logp: torch.Tensor
    replay: list[torch.Tensor] | None  # per MoE layer [T, top_k] int64, layer order
    episodes: torch.Tensor | None = None  # [S] each sequence's episode number (RLBatch.episodes)


def _local_normaliser(
    mask: torch.Tensor, cu_seqlens: torch.Tensor, aggregation: str, max_tokens: int | None, episodes: torch.Tensor | None = None
) -> float:
    """What `step_math.aggregate` divides this rank's sum by (the denominator of `step_math.aggregate_terms`):
    policy tokens (token_mean), sequences with a policy token (seq_mean), or the generation budget times
    the sequences (constant, Dr.GRPO)."""
    return float(step_math.aggregate_terms(mask, mask, cu_seqlens, aggregation, max_tokens=max_tokens, episodes=episodes)[1])


class _PolicyLoss:
    """The PPO loss of one batch over its updates. The first call sees the policy before any update
    (pi_old): it fixes the correction weights, the clip fraction and, for "recompute", the old log-probs.

    Global aggregation: this rank's mean times `share` (its normaliser over the whole batch's) is its
    part of the whole batch's mean, what `losses` records; the backward takes it times the data-parallel
    size, since megatron's DDP averages gradients over the ranks, so the summed gradient is the
    gradient of the whole batch's mean."""

    def __init__(self, rl: RLSettings, inputs: _Inputs, share: float = 1.0, dp_size: int = 1):
        self.rl = rl
        self.inputs = inputs
        self.share = share
        self.dp_size = dp_size
        self.first_logp: torch.Tensor | None = None
        self.weights = torch.empty(0)
        self.clip_frac = 0.0
        self.losses: list[float] = []

    def __call__(self, logp: torch.Tensor) -> torch.Tensor:
        rl, x = self.rl, self.inputs
        first = self.first_logp is None
        if first:
            self.first_logp = logp.detach()
            self.weights = step_math.correction_weights(
                rl.correction, self.first_logp - x.sampler_logp, x.mask, x.cu_seqlens, cap=rl.tis_cap, alpha=rl.alpha,
                beta=rl.beta,
            )
        old = x.sampler_logp if rl.old_policy == "sampler" else self.first_logp
        per_token, clipped = step_math.ppo_clipped_loss(logp, old, x.advantages, rl.clip_low, rl.clip_high)
        if first:
            self.clip_frac = float((clipped * x.mask).sum() / x.mask.sum().clamp(min=1))
        loss = step_math.aggregate(
            per_token * self.weights, x.mask, x.cu_seqlens, rl.aggregation, max_tokens=rl.max_generation_tokens,
            episodes=x.episodes,
        ) * self.share
        self.losses.append(float(loss.detach()))
        return loss * self.dp_size


class RLTrainer:
    """Model, optimizer and one RL step per batch; `run_rl` feeds it. One per rank (see RLConfig).

    A new RLTrainer resumes from the run's latest checkpoint (`resumed_from`, `data_position`), or
    starts from `init_checkpoint`'s weights.
    """

    def __init__(self, config: RLConfig):
        from megatron.core import parallel_state

        from ember.midtrain import checkpoint

        self.config = config
        checkpoint.start_writer_helper()  # first: a forked helper must inherit no process-group sockets
        self.cpu_patched = runtime.start(config.parallel, config.rl.seed)
        self.rank = dist.get_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.control = dist.new_group(backend="gloo")  # batches and stop flags travel on CPU, even next to NCCL
        self.device = runtime.compute_device()
        parts = runtime.build_model_and_optimizer(policy_model_config(config), bf16=False, cpu_patched=self.cpu_patched)
        self.model, self.ddp, self.optimizer = parts.model, parts.ddp, parts.optimizer
        # constant lr: RL runs as long as rollouts come
        runtime.set_learning_rate(self.optimizer, config.optimizer.weight_decay, lambda group: config.optimizer.lr)
        self.attention = packed_attention(self.model)
        self.routers = moe_routers(self.model)
        self._maps: list[torch.Tensor] | None = None
        for router in self.routers:
            router.register_forward_hook(self._capture_routing)
        self.state = checkpoint.TrainState()
        self.data_position: dict[str, Any] | None = None
        self.publisher = None  # rank 0's VersionPublisher, made at the first export
        self.resumed_from = checkpoint.latest_checkpoint(config.checkpoint_dir)
        if self.resumed_from is not None:
            self.load_checkpoint(self.resumed_from)
        elif config.init_checkpoint is not None:
            checkpoint.load_model_weights(config.init_checkpoint, self.model)

    def rank_batches(
        self, messages: Iterable[BatchMessage | None] | None, stop: StopRequest, fetch: RolloutSource | None = None
    ) -> RankBatches:
        """This rank's share of each batch `messages` (read on rank 0 only) delivers; `fetch` reads this
        rank's rollouts of a by-reference batch."""
        return RankBatches(messages, stop, self.control, self.dp_rank, self.dp_size, fetch)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (a stop request must end the same step everywhere)."""
        value = torch.tensor([float(flag)], dtype=torch.float64)
        dist.all_reduce(value, group=self.control)
        return bool(value[0] > 0)

    def _global_share(self, inputs: _Inputs) -> float:
        """This rank's normaliser over the whole batch's, for `_PolicyLoss`."""
        local = _local_normaliser(
            inputs.mask, inputs.cu_seqlens, self.config.rl.aggregation, self.config.rl.max_generation_tokens, inputs.episodes
        )
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.control)
        return local / max(float(total[0]), 1.0)

    @property
    def policy_version(self) -> int:
        return self.config.rl.initial_policy_version + self.state.step

    def _capture_routing(self, module: Any, inputs: Any, output: Any) -> None:
        if self._maps is not None:
            self._maps.append(output[1].detach())

    def _replay_indices(self, experts: torch.Tensor | None) -> list[torch.Tensor] | None:
        """The sampler's experts per MoE layer when replay is on, after checking they fit this model."""
        if self.config.rl.replay != "replay" or experts is None:
            return None
        moe = self.config.moe
        layers, top_k = experts.shape[1], experts.shape[2]
        if (layers, top_k) != (len(self.routers), moe.router_topk):
            raise ValueError(
                f"the batch's routed experts are [T, {layers}, {top_k}], the model has {len(self.routers)} MoE "
                f"layers with top-{moe.router_topk}: the rollouts came from another model"
            )
        if int(experts.max()) >= moe.num_experts:
            raise ValueError(f"routed expert id {int(experts.max())} >= moe.num_experts {moe.num_experts}")
        if step_math.repeats_an_expert(experts):
            raise ValueError("the batch's routed experts repeat an expert within a token's top-k: not a router's output")
        return [experts[:, layer, :].long() for layer in range(layers)]

    def _inputs(self, batch: RLBatch) -> _Inputs:
        estimator = self.config.rl.estimator
        stated = batch.advantage_estimators or (batch.advantage_estimator,)
        foreign = sorted({e for e in stated if e is not None and e != estimator and not e.startswith(SINGLE_SAMPLE_ESTIMATOR_PREFIX)})
        if foreign:
            raise ValueError(
                f"batch {batch.batch_id}: its advantages are {' and '.join(foreign)}'s, rl.estimator is {estimator} "
                f"(loss normaliser {self.config.rl.aggregation}): set the ETL's advantages.estimator and rl.estimator alike"
            )
        b = batch.to(self.device)
        cu = b.cu_seqlens
        replay = self._replay_indices(b.routed_experts)
        if int(b.tokens.max()) >= self.model.vocab_size:
            raise ValueError(f"token id {int(b.tokens.max())} is outside the model's {self.model.vocab_size}-row vocabulary")
        mask = step_math.trainable_mask(b.loss_mask, cu)
        budget = self.config.rl.max_generation_tokens
        if budget is not None:
            over = step_math.check_generation_budget(mask, cu, budget)
            if over is not None:
                raise ValueError(
                    f"batch {batch.batch_id}: rollout {batch.rollout_ids[over]} has more policy tokens than "
                    f"rl.max_generation_tokens {budget}, the constant Dr.GRPO's loss divides by: raise it to the "
                    "sampler's generation budget"
                )
        attention_mask, packed = attention_inputs(self.attention, cu)
        return _Inputs(
            tokens=b.tokens,
            labels=step_math.next_token_labels(b.tokens, cu),
            positions=b.position_ids,
            attention_mask=attention_mask,
            packed=packed,
            cu_seqlens=cu,
            mask=mask,
            advantages=b.advantages.float(),
            sampler_logp=b.sampler_logprobs.float(),
            replay=replay,
            episodes=b.episodes,
        )

    def _set_replay(self, action: Any, indices: list[torch.Tensor] | None = None) -> None:
        for layer, router in enumerate(self.routers):
            if indices is not None:
                router.router_replay.clear_indices()
                router.router_replay.set_target_indices(indices[layer])
            router.router_replay.set_router_replay_action(action)

    def _clear_replay(self) -> None:
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def _forward_step(self, inputs: _Inputs, loss_fn: _PolicyLoss, data_iterator: Iterator, model_chunk: Any) -> tuple:
        """megatron's forward step: the packed batch through the model, the sampler's experts forced on replay."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        next(data_iterator)
        if inputs.replay is not None:
            self._set_replay(RouterReplayAction.REPLAY_FORWARD, inputs.replay)
        return _model_forward(model_chunk, inputs), partial(self._loss, inputs, loss_fn)

    def _loss(self, inputs: _Inputs, loss_fn: _PolicyLoss, per_token_loss: torch.Tensor) -> tuple:
        """megatron's loss function: token log-probs from the per-token loss, then the policy loss."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if inputs.replay is not None:
            self._set_replay(RouterReplayAction.REPLAY_BACKWARD)
        token_logp = step_math.token_logprobs(-per_token_loss[0].float(), inputs.cu_seqlens)
        loss = loss_fn(token_logp)
        return loss, torch.tensor(1, dtype=torch.int), {"rl loss": loss.detach()}

    def _forward_backward(self, inputs: _Inputs, loss_fn: _PolicyLoss) -> None:
        """One forward + backward through megatron's schedule.

        With replay the routers take the sampler's indices in the forward (REPLAY_FORWARD) and the
        same ones if activation recompute re-runs the router during backward (REPLAY_BACKWARD); the
        router's own scores are gathered at those indices, so the router still gets gradients.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        try:
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, inputs, loss_fn),
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

    def logprobs(self, batch: RLBatch) -> torch.Tensor:
        """[T] the policy's per-token log-probs of `batch` (0 on sequence starts), no update: the first
        forward of `train_step` without backward or dropout, the sampler's experts replayed when configured."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        inputs = self._inputs(batch)
        if inputs.replay is not None:
            self._set_replay(RouterReplayAction.REPLAY_FORWARD, inputs.replay)
        training = self.model.training
        self.model.eval()  # no dropout when scoring
        try:
            with torch.no_grad():
                per_token_loss = _model_forward(self.model, inputs)
        finally:
            self.model.train(training)
            if inputs.replay is not None:
                self._clear_replay()
        return step_math.token_logprobs(-per_token_loss[0].float(), inputs.cu_seqlens).cpu()

    def train_step(self, batch: RLBatch) -> dict[str, Any]:
        """Trains on one batch (`updates_per_batch` optimizer updates); returns its metrics line."""
        started = time.perf_counter()
        inputs = self._inputs(batch)
        loss = _PolicyLoss(self.config.rl, inputs, self._global_share(inputs), self.dp_size)
        maps: list[torch.Tensor] = []  # the routing of the first update's forward
        forward_s = 0.0
        for update in range(self.config.rl.updates_per_batch):
            self._maps = maps if update == 0 else None
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            t0 = time.perf_counter()
            self._forward_backward(inputs, loss)
            forward_s += time.perf_counter() - t0
            self.optimizer.step()
        self._maps = None
        self.state.step += 1
        self.data_position = batch.position
        record = self._record(batch, inputs, loss)
        self.state.consumed_samples += record["sequences"]
        compare_s = 0.0
        if batch.routed_experts is not None:
            t0 = time.perf_counter()
            per_layer = [step_math.routing_disagreement(m.cpu(), batch.routed_experts[:, layer, :]) for layer, m in enumerate(maps)]
            per_layer = self._token_weighted_mean(per_layer, len(inputs.tokens))
            record["routing_disagreement"] = float(np.mean(per_layer))
            record["routing_disagreement_per_layer"] = per_layer
            compare_s = time.perf_counter() - t0
        # after the routing comparison, so the step time holds everything the step does
        record.update(
            step_seconds=time.perf_counter() - started, forward_backward_seconds=forward_s, routing_compare_seconds=compare_s
        )
        return record

    def _token_weighted_mean(self, values: list[float], weight: float) -> list[float]:
        """Per-rank means of the whole batch: weighted by each rank's count, summed over ranks."""
        sums = torch.tensor([*(v * weight for v in values), weight], dtype=torch.float64)
        dist.all_reduce(sums, group=self.control)
        return (sums[:-1] / sums[-1].clamp(min=1)).tolist()

    def _record(self, batch: RLBatch, inputs: _Inputs, loss: _PolicyLoss) -> dict[str, Any]:
        """The step's metrics line for the whole batch: sums and token-weighted means reduced over ranks."""
        rl, mask = self.config.rl, inputs.mask
        local_policy = float(mask.sum())
        mismatch = step_math.mismatch_metrics(loss.first_logp, inputs.sampler_logp, mask, rl.alpha, rl.beta, rl.tis_cap)
        means = {
            "clip_frac": loss.clip_frac,
            "correction_mean_weight": float((loss.weights * mask).sum()) / max(local_policy, 1.0),
            "correction_kept_frac": float(((loss.weights > 0).float() * mask).sum()) / max(local_policy, 1.0),
            **{f"mismatch/{k}": v for k, v in mismatch.items() if k not in _EXTREMES},
        }
        sums = torch.tensor(
            [batch.num_sequences, len(inputs.tokens), local_policy, loss.losses[0], loss.losses[-1],
             *(v * local_policy for v in means.values())],
            dtype=torch.float64,
        )
        dist.all_reduce(sums, group=self.control)
        extremes = torch.tensor(
            [mismatch["max_abs_delta_logp"], mismatch["rho_max"], -mismatch["rho_min"], -float(batch.policy_versions.min())],
            dtype=torch.float64,
        )
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.control)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (batch.num_sequences, batch.decoded_bytes, batch.routed_expert_bytes), group=self.control)
        policy_tokens = float(sums[2])
        reduced = {k: float(v) / max(policy_tokens, 1.0) for k, v in zip(means, sums[5:].tolist())}
        return {
            "step": self.state.step,
            "batch_id": batch.batch_id,
            "batch_step": batch.step,
            "sequences": int(sums[0]),
            "tokens": int(sums[1]),
            "policy_tokens": int(policy_tokens),
            "loss": float(sums[3]),
            "loss_last_update": float(sums[4]),
            "clip_frac": reduced["clip_frac"],
            "correction": rl.correction,
            "correction_mean_weight": reduced["correction_mean_weight"],
            "correction_kept_frac": reduced["correction_kept_frac"],
            "mismatch": {
                **{k.removeprefix("mismatch/"): v for k, v in reduced.items() if k.startswith("mismatch/")},
                "max_abs_delta_logp": float(extremes[0]),
                "rho_max": float(extremes[1]),
                "rho_min": -float(extremes[2]),
            },
            "replayed": inputs.replay is not None,
            "policy_version": self.policy_version,
            "max_policy_lag": int(self.policy_version - 1 + int(extremes[3])),
            "ranks": dist.get_world_size(),
            "rank_sequences": [r[0] for r in per_rank],
            "rank_decoded_bytes": [r[1] for r in per_rank],
            "rank_routed_expert_bytes": [r[2] for r in per_rank],
        }

    def save(self) -> Path:
        """A checkpoint of the model, optimizer, step and the position of the last trained batch."""
        from ember.midtrain import checkpoint
        from ember.midtrain.export_hf import architecture_record

        return checkpoint.save(
            self.config.checkpoint_dir, self.model, self.optimizer, self.state, self.config.rollouts.batches_topic,
            self.config.rl.keep_checkpoints,
            extra={"reader": self.data_position, "architecture": architecture_record(self.config.model, self.config.moe)},
        )

    def export_version(self, checkpoint_path: Path) -> PolicyVersion | None:
        """Publishes the checkpointed policy (`checkpoint_path`, this step's) as version `policy_version`
        (`VersionPublisher`: full or a delta, under run_dir/versions and rl.publish_uri) and returns its
        announcement; None on ranks other than 0."""
        from ember.midtrain.rl.publish import VersionPublisher

        if dist.get_rank() != 0:
            return None
        if self.publisher is None:
            self.publisher = VersionPublisher.for_run(self.config)
        published = self.publisher.publish(checkpoint_path, self.policy_version, self.state.step)
        return PolicyVersion.now(self.policy_version, published.uri, published.sha256)

    def load_checkpoint(self, path: Path) -> None:
        from ember.midtrain import checkpoint

        self.state, _ = checkpoint.load(path, self.model, self.optimizer, self.config.rollouts.batches_topic)
        self.data_position = checkpoint.load_extra(path).get("reader")

    def close(self) -> None:
        runtime.shutdown()


def _model_forward(model_chunk: Any, inputs: _Inputs) -> torch.Tensor:
    """[1, T] per-token loss of the packed row: THD parameters or the dense mask, whichever the built
    attention honours (`_Inputs` carries exactly one of them)."""
    return model_chunk(
        inputs.tokens[None], inputs.positions[None], inputs.attention_mask, labels=inputs.labels[None],
        packed_seq_params=inputs.packed,
    )


FAR_SAMPLER_SHARE = 0.5
"""A share of tokens with rho outside [alpha, beta] above which the step line says why once: the sampler's
log-probs did not come from (a recent copy of) this model."""


def _print_step(record: dict[str, Any], steps: int, rl: Any, explained: set[str]) -> None:
    """The step's line; a metric that has no value says why ("n/a (...)"), and a first far-off `outside` is
    explained once (`explained` holds the notes already printed)."""
    m = record["mismatch"]
    routing = record.get("routing_disagreement")
    print(
        f"[rl] step {record['step']}/{steps} batch {record['batch_id']} loss {record['loss']:.4f} "
        f"|dlogp| {m['mean_abs_delta_logp']:.4f} kl {m['kl_mu_pi']:.2e} outside {m['frac_outside']:.3f} "
        f"routing-disagree {'n/a (the batch carries no routed experts)' if routing is None else f'{routing:.3f}'} "
        f"{record['step_seconds']:.2f}s",
        flush=True,
    )
    if rl.replay == "replay" and not record["replayed"] and "unreplayed" not in explained:
        explained.add("unreplayed")
        print(
            f"[rl] note: batch {record['batch_id']} carries no routed experts (its sampler cannot supply them, e.g. "
            "an HTTP engine): its steps run without router replay, the trainer routing by itself",
            flush=True,
        )
    if m["frac_outside"] > FAR_SAMPLER_SHARE and "outside" not in explained:
        explained.add("outside")
        print(
            f"[rl] note: outside is the share of tokens whose ratio rho = pi/mu lies outside [{rl.alpha}, {rl.beta}]; "
            f"above {FAR_SAMPLER_SHARE} the sampler's log-probs are far from this model's (a simulator, or a policy "
            "other than this run's): the correction then masks or caps most tokens",
            flush=True,
        )


def _announce(trainer: RLTrainer, channel: PolicyChannel | None, checkpoint: Path) -> None:
    """Exports the checkpointed policy, then announces it: never the other way round (rank 0, which holds the
    channel; the checkpoint is complete on every rank once `save` returns)."""
    if channel is None:
        return
    crash_point("rl.before_export")
    record = trainer.export_version(checkpoint)
    crash_point("rl.before_announce")
    if record is not None:
        channel.announce(record)


def run_rl(trainer: RLTrainer, batches: Iterable[RLBatch], channel: PolicyChannel | None, stop: StopRequest) -> None:
    """Trains until rl.steps, a stop request (on any rank) or the end of `batches`; `channel.step_done()` after
    every step (rank 0 holds the channel; None on the others). Checkpoints every save_interval steps and once at
    the end. Announced, each after its checkpoint and export: the starting version (after a crash, maybe a
    checkpoint that was never announced), every checkpointed version `rl.announces`, and the last. Every rank
    runs it, on its `rank_batches` share of the same batches."""
    config, rl = trainer.config, trainer.config.rl
    lead = trainer.rank == 0  # writes the metrics, announces versions and prints; every rank trains and saves
    with MetricsLog(config.metrics_path, enabled=lead, first_step=trainer.state.step + 1) as metrics:
        if trainer.resumed_from is not None:
            metrics.write({"event": "resumed", "step": trainer.state.step, "checkpoint": str(trainer.resumed_from)})
        if lead:
            if trainer.resumed_from is not None:
                print(f"[rl] resumed from {trainer.resumed_from} at step {trainer.state.step}", flush=True)
            if trainer.cpu_patched:
                print("[rl] no GPU: CPU compatibility patches active, gloo backend, fp32, grad clipping off", flush=True)
            print(f"[rl] {dist.get_world_size()} rank(s), dp {trainer.dp_size}, {torch.get_num_threads()} CPU thread(s) per rank", flush=True)
        checkpoint = trainer.resumed_from or trainer.save()
        _announce(trainer, channel, checkpoint)
        saved_step = announced_step = trainer.state.step
        pending, explained = iter(batches), set()
        while trainer.state.step < rl.steps and not trainer.any_rank(stop.signal is not None):
            batch = next(pending, None)
            if batch is None:
                break
            record = trainer.train_step(batch)
            record["offset"] = batch.offset
            if rl.save_interval and trainer.state.step % rl.save_interval == 0:
                checkpoint, saved_step = trainer.save(), trainer.state.step
                if rl.announces(trainer.state.step):
                    _announce(trainer, channel, checkpoint)
                    announced_step = trainer.state.step
            metrics.write(record)
            if lead:
                if channel is not None:
                    channel.step_done()
                _print_step(record, rl.steps, rl, explained)
        if saved_step != trainer.state.step:
            checkpoint = trainer.save()
        if announced_step != trainer.state.step:
            _announce(trainer, channel, checkpoint)
        if lead:
            if trainer.state.step >= rl.steps:
                config.complete_marker.write_text(f"{trainer.state.step}\n")
            print(f"[rl] {'finished' if trainer.state.step >= rl.steps else 'stopped'} at step {trainer.state.step}", flush=True)
