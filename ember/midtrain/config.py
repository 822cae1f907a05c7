"""The `midtrain` and `midtrain rl` run configs: one YAML file each, validated before anything is built or submitted.

The RL config (`RLConfig`) shares the model, moe and optimizer sections with mid-training, so the policy
checkpoint a mid-training run wrote loads into the RL trainer unchanged; it adds rollouts and RL sections.
Both live here because the runtime and the launcher, below the RL trainer, take either.

Every section forbids unknown keys, so a typo fails with the key's dotted path instead of being
ignored. Relative paths are resolved against the config file's directory, so a config and the
shard sets it names can move together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ember import configs
from ember.configs import MidtrainConfigError, StrictModel, at_most
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics
from ember.tokenize.config import MAX_SEQ_LEN, SEQ_LEN_WHY

MAX_RANK_BYTES = 2**40
"""1 TiB: more than any accelerator or training host holds per rank; the estimate (`rank_memory`) is a lower bound."""
MAX_MICRO_BATCH_TOKENS = 2**24
"""16M tokens in one micro batch: 16x a 1M-token sequence; its activations alone fill any device."""
SEED_WHY = "numpy seeds are below 2^32 and a resume adds the step to the seed"
HIDDEN = at_most(65_536, "over twice the widest published model")


class ModelConfig(StrictModel):
    tokenizer: str = Field(min_length=1, description="tokenizer name every shard set's manifest must carry")
    vocab_size: Annotated[int, at_most(4_194_304, "16x the largest published vocabulary; it sizes the embedding and logits")] = Field(
        gt=0, description="must equal the manifests' tokenizer vocab_size"
    )
    seq_len: Annotated[int, at_most(MAX_SEQ_LEN, SEQ_LEN_WHY)] = Field(gt=1, description="must equal the manifests' seq_len")
    num_layers: Annotated[int, at_most(1024, "over five times the deepest published transformer")] = Field(gt=0)
    hidden_size: Annotated[int, HIDDEN] = Field(gt=0)
    num_attention_heads: Annotated[int, at_most(1024, "over ten times any published model")] = Field(gt=0)
    num_query_groups: int | None = Field(default=None, gt=0)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    swiglu: bool = True
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    rotary_base: int = Field(default=10000, gt=0)
    init_std: float = Field(default=0.02, gt=0)
    hidden_dropout: float = Field(default=0.0, ge=0, lt=1)
    attention_dropout: float = Field(default=0.0, ge=0, lt=1)
    vocab_pad_multiple: Annotated[int, at_most(4096, "padding beyond it only wastes embedding rows")] = Field(
        default=128, gt=0, description="embedding rows are padded to a multiple of this x TP"
    )

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        problems = []
        if self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups {self.num_query_groups}")
        configs.check(problems)
        return self


class MoEConfig(StrictModel):
    num_experts: Annotated[int, at_most(4096, "over ten times any published MoE; the router scores every expert per token")] = Field(gt=1)
    router_topk: Annotated[int, at_most(64, "each token is dispatched to this many experts")] = Field(gt=0)
    ffn_hidden_size: Annotated[int, HIDDEN] = Field(gt=0, description="hidden size of each routed expert")
    shared_expert_ffn_hidden_size: Annotated[int | None, HIDDEN] = Field(default=None, gt=0, description="None: no shared expert")
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = Field(default=1e-3, ge=0)
    expert_bias: bool = Field(default=False, description="aux-loss-free balancing by a per-expert routing bias")
    expert_bias_update_rate: float = Field(default=1e-3, gt=0)
    token_dispatcher: Literal["allgather", "alltoall", "flex"] = "alltoall"
    routing_replay: bool = Field(default=False, description="megatron's moe_enable_routing_replay (router replay for RL)")
    grouped_gemm: bool = Field(default=False, description="needs Transformer Engine")

    @model_validator(mode="after")
    def _routing(self) -> "MoEConfig":
        problems = []
        if self.router_topk > self.num_experts:
            problems.append(f"router_topk {self.router_topk} exceeds num_experts {self.num_experts}")
        if self.expert_bias and self.router_score_function != "sigmoid":
            problems.append("expert_bias needs router_score_function: sigmoid")
        if self.router_topk == 1 and self.router_score_function == "softmax":
            problems.append("router_topk 1 with softmax scores gives the router no gradient; use topk >= 2 or sigmoid")
        configs.check(problems)
        return self


RANKS = at_most(1024, "ranks in one parallel dimension")


class ParallelConfig(StrictModel):
    tensor: Annotated[int, RANKS] = Field(default=1, gt=0)
    pipeline: Annotated[int, RANKS] = Field(default=1, gt=0)
    expert: Annotated[int, RANKS] = Field(default=1, gt=0)
    threads: Annotated[int | None, at_most(1024, "CPU threads of one rank; more than any node has cores")] = Field(
        default=None, gt=0,
        description="CPU threads per rank (torch.set_num_threads, OMP_NUM_THREADS); a Slurm job asks for this x ranks per "
        "node as --cpus-per-task. null: 1 per CPU rank and 8 per GPU rank on Slurm, this machine's CPUs shared by the "
        "ranks locally; --threads overrides it",
    )


class OptimizerConfig(StrictModel):
    lr: float = Field(gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    adam_beta1: float = Field(default=0.9, gt=0, lt=1)
    adam_beta2: float = Field(default=0.95, gt=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    clip_grad: float = Field(default=1.0, ge=0, description="0 disables; always 0 on CPU (megatron asserts CUDA grads)")

    @model_validator(mode="after")
    def _lrs(self) -> "OptimizerConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} exceeds lr {self.lr}")
        return self


class ScheduleConfig(StrictModel):
    """Warmup-stable-decay: linear warmup, constant, then decay to min_lr over the last steps."""

    warmup_steps: int = Field(default=0, ge=0)
    decay_steps: int = Field(default=0, ge=0)
    decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"


class ShardSetConfig(StrictModel):
    path: Path | str = Field(description="a shard-set directory: local path, gs://BUCKET/... or s3://BUCKET/...")
    weight: float = Field(default=1.0, gt=0)

    @field_validator("path", mode="before")
    @classmethod
    def _path_or_url(cls, value: object) -> object:
        """A URL stays a string (the data check names a typo in it before training starts: see data.local_specs);
        anything else is a local Path."""
        if isinstance(value, str) and "://" not in value:
            return Path(value)
        return value


class DataConfig(StrictModel):
    shard_sets: list[ShardSetConfig] = Field(min_length=1)
    seed: int = Field(default=1234, ge=0, lt=2**63)
    blend_period: Annotated[
        int, at_most(1_000_000, "the loader computes one period's order in Python as it starts, ~2.5 s per million")
    ] = Field(default=1000, gt=0, description="positions per exact blend cycle")
    shuffle_window_chunks: Annotated[int, at_most(4096, "each loader keeps this many decoded record batches per shard set")] = Field(
        default=64, gt=0, description="record batches shuffled together; each loader keeps this many decoded per shard set"
    )
    num_workers: Annotated[int, at_most(64, "loader processes per rank, each holding its own shuffle windows")] = Field(default=2, ge=0)
    cache_mib: Annotated[int, at_most(65536, "each loader process of each rank holds this much")] = Field(
        default=512, gt=0,
        description="decoded bytes each loader process holds: the record batches of a shuffle window when it fits "
        "in 3/4, and rows read ahead in the sampler's order (the rest; nearly all of it for a global shuffle)",
    )


class TrainConfig(StrictModel):
    steps: Annotated[int, at_most(10**9, "more than any run takes; a larger number is a typo")] = Field(gt=0)
    micro_batch_size: Annotated[int, at_most(4096, "sequences in one forward pass on one rank")] = Field(gt=0)
    global_batch_size: Annotated[int, at_most(1_048_576, "sequences per optimizer step, far beyond any published run")] = Field(gt=0)
    seed: Annotated[int, at_most(2**31 - 1, SEED_WHY)] = Field(default=1234, ge=0)
    precision: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="auto: bf16 on GPU, fp32 on CPU")
    save_interval: int = Field(default=0, ge=0, description="steps between checkpoints; 0: only at the end and on signal")
    log_interval: int = Field(default=1, gt=0)
    keep_checkpoints: Annotated[int, at_most(1000, "each one is a full model and optimizer state on disk")] = Field(default=2, gt=0)

    @model_validator(mode="after")
    def _batches(self) -> "TrainConfig":
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}"
            )
        return self


class RunDirectory:
    """Where a run (mid-training or RL) keeps its checkpoints, metrics and completion marker
    (mixed into configs that have a `run_dir`)."""

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def complete_marker(self) -> Path:
        """Written when every step has run, so a requeue trap knows not to requeue."""
        return self.run_dir / "COMPLETE"


def rank_memory(model: ModelConfig, moe: MoEConfig, parallel: ParallelConfig, tokens: int) -> tuple[int, int]:
    """A lower bound on one rank's (training state, micro batch activation) bytes, so a config no machine can
    hold is refused at load instead of after minutes of start-up (or a segfault).

    State: 16 bytes per parameter this rank holds (weights, gradients, Adam's two moments), the experts split
    over `expert` ranks, layers over `pipeline`, every matrix over `tensor` (untied input and output embeddings).
    Activations: 34 bytes per token,
    hidden unit and layer (Korthikanti et al. 2022, without attention scores) plus fp32 logits.
    """
    h, ffn_mats = model.hidden_size, 3 if model.swiglu else 2
    kv = h * (model.num_query_groups or model.num_attention_heads) // model.num_attention_heads
    attention = 2 * h * h + 2 * h * kv
    experts = moe.num_experts * ffn_mats * h * moe.ffn_hidden_size // parallel.expert
    shared = ffn_mats * h * (moe.shared_expert_ffn_hidden_size or 0)
    layers = model.num_layers // parallel.pipeline
    vocab = model.vocab_size + (-model.vocab_size) % (model.vocab_pad_multiple * parallel.tensor)
    params = (layers * (attention + shared + experts + h * moe.num_experts) + 2 * vocab * h) // parallel.tensor
    activations = 34 * tokens * h * layers // parallel.tensor + 4 * tokens * vocab // parallel.tensor
    return 16 * params, activations


def memory_problems(model: ModelConfig, moe: MoEConfig, parallel: ParallelConfig, tokens: int) -> list[str]:
    """The estimate of `rank_memory` as a problem line when it exceeds MAX_RANK_BYTES."""
    state, activations = rank_memory(model, moe, parallel, tokens)
    if state + activations <= MAX_RANK_BYTES:
        return []
    parts = f"{configs.gib(state)} weights and optimizer state" + (
        f", {configs.gib(activations)} activations of a {tokens:,}-token micro batch" if tokens else ""
    )
    return [
        f"one rank needs at least {configs.gib(state + activations)} ({parts}); at most {configs.gib(MAX_RANK_BYTES)} "
        "(a smaller model or micro batch, or more tensor / pipeline / expert parallelism)"
    ]


class MidtrainConfig(RunDirectory, StrictModel):
    run_dir: Path = Field(description="checkpoints/, metrics.jsonl and logs/ are written here")
    model: ModelConfig
    moe: MoEConfig
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig
    train: TrainConfig

    @model_validator(mode="after")
    def _consistent(self) -> "MidtrainConfig":
        problems = []
        if self.moe.num_experts % self.parallel.expert:
            problems.append(f"parallel.expert {self.parallel.expert} does not divide moe.num_experts {self.moe.num_experts}")
        if self.model.num_attention_heads % self.parallel.tensor:
            problems.append(f"parallel.tensor {self.parallel.tensor} does not divide model.num_attention_heads")
        if self.model.num_layers % self.parallel.pipeline:
            problems.append(f"parallel.pipeline {self.parallel.pipeline} does not divide model.num_layers {self.model.num_layers}")
        if self.schedule.warmup_steps + self.schedule.decay_steps > self.train.steps:
            problems.append(
                f"schedule.warmup_steps + schedule.decay_steps ({self.schedule.warmup_steps} + "
                f"{self.schedule.decay_steps}) exceed train.steps {self.train.steps}"
            )
        tokens = self.train.micro_batch_size * self.model.seq_len
        if tokens > MAX_MICRO_BATCH_TOKENS:
            problems.append(
                f"train.micro_batch_size x model.seq_len = {tokens:,} tokens per micro batch; at most {MAX_MICRO_BATCH_TOKENS:,} "
                "(its activations alone fill any device)"
            )
        else:
            problems.extend(memory_problems(self.model, self.moe, self.parallel, tokens))
        configs.check(problems)
        return self



def _resolve(data: dict, base: Path) -> dict:
    data = dict(data)
    if isinstance(data.get("run_dir"), str):
        data["run_dir"] = str((base / data["run_dir"]).resolve())
    sets = (data.get("data") or {}).get("shard_sets") if isinstance(data.get("data"), dict) else None
    if isinstance(sets, list):
        data["data"] = {
            **data["data"],
            "shard_sets": [
                {**s, "path": str((base / s["path"]).resolve())}
                if isinstance(s, dict) and isinstance(s.get("path"), str) and "://" not in s["path"]
                else s
                for s in sets
            ],
        }
    return data


def parse_config(data: dict, base: Path, where: str = "config") -> MidtrainConfig:
    return configs.validate(MidtrainConfig, _resolve(data, base), where, MidtrainConfigError)


def load_config(path: str | Path) -> MidtrainConfig:
    path = Path(path)
    data = configs.read_yaml_mapping(path, MidtrainConfigError, sections="model, moe, data, ...")
    return parse_config(data, path.resolve().parent, str(path))


MAX_POLICY_VERSION = 2**63 - 1
"""Policy versions travel as int64 in every TrainBatch and policy announcement."""


class RolloutsConfig(StrictModel):
    topic_prefix: str = Field(min_length=1, description="batches come from <prefix>.train-batches; versions go to <prefix>.policy-versions")
    group_id: str = Field(default="ember-trainer", min_length=1, description="the trainer's consumer group")
    bootstrap: str | None = Field(default=None, description="Kafka brokers; default: EMBER_KAFKA_BOOTSTRAP or 127.0.0.1:19092")
    idle_timeout_s: float | None = Field(
        default=None, gt=0, description="checkpoint and exit when no batch arrives for this long; null: wait forever"
    )
    security: KafkaSecurity = Field(
        default_factory=KafkaSecurity, description="TLS / SASL as the trainer principal; keys left out come from EMBER_KAFKA_*"
    )

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def batches_topic(self) -> str:
        return self.topics.train_batches


class RLSettings(StrictModel):
    steps: Annotated[int, at_most(10**9, "more than any run takes; a larger number is a typo")] = Field(
        gt=0, description="batches to train on (one optimizer step each, times updates_per_batch)"
    )
    replay: Literal["off", "replay"] = Field(default="replay", description="force the sampler's routed experts (router replay)")
    correction: Literal["none", "tis", "mis", "seq_geo"] = Field(default="tis", description="train/inference mismatch correction")
    tis_cap: float = Field(default=2.0, gt=0, description="C in min(rho, C)")
    alpha: float = Field(default=0.5, gt=0, description="lower bound on rho for mis / seq_geo (and the reported fraction outside)")
    beta: float = Field(default=2.0, gt=0, description="upper bound on rho for mis / seq_geo")
    old_policy: Literal["sampler", "recompute"] = Field(
        default="recompute", description="PPO ratio against the sampler's log-probs or the trainer's own before the update"
    )
    clip_low: float = Field(default=0.2, ge=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(default=0.28, ge=0, description="ratio clipped above at 1 + clip_high")
    estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        default="grpo",
        description="the advantage estimator of the ETL that writes the batches (its advantages.estimator, checked on "
        "every batch); it picks the loss normaliser: dr_grpo the constant one, the others token_mean",
    )
    aggregation: Literal["token_mean", "seq_mean", "constant"] = Field(
        default="token_mean",
        description="loss normaliser, when left out the estimator's: token_mean | seq_mean (grpo, rloo), constant = sum / (max_generation_tokens x "
        "sequences) (dr_grpo only)",
    )
    max_generation_tokens: int | None = Field(
        default=None, gt=0, description="dr_grpo: the sampler's generation budget, the constant the loss divides by"
    )
    updates_per_batch: Annotated[int, at_most(64, "PPO epochs on one batch; more only overfits it")] = Field(
        default=1, gt=0, description="optimizer updates on each batch (PPO epochs)"
    )
    seed: Annotated[int, at_most(2**31 - 1, SEED_WHY)] = Field(default=1234, ge=0)
    save_interval: int = Field(default=1, ge=0, description="steps between checkpoints; 0: only at the end and on signal")
    keep_checkpoints: Annotated[int, at_most(1000, "each one is a full model and optimizer state on disk")] = Field(default=2, gt=0)
    initial_policy_version: int = Field(default=0, ge=0, description="the version of the starting weights; step k is this + k")
    publish_interval: int | None = Field(
        default=None, gt=0,
        description="steps between announced policy versions, each exported (safetensors + config.json) and announced "
        "with its URI and sha256; a multiple of save_interval, so only checkpointed weights are announced and a resume "
        "never retrains an announced version. null: every checkpoint. The starting and the final version are always announced",
    )
    keep_versions: Annotated[int, at_most(1000, "each one is a full copy of the weights on disk")] = Field(
        default=4, gt=0, description="exported versions kept under run_dir/versions (and publish_uri); older ones are removed"
    )
    publish_uri: str | None = Field(
        default=None, description="gs://BUCKET/PREFIX or s3://BUCKET/PREFIX: each version is uploaded under it (files "
        "first, export.json last) and announced there. null: announced at run_dir/versions",
    )
    full_every_k: Annotated[int, at_most(1000, "a late sampler rebuilds up to this many versions")] = Field(
        default=1, gt=0, description="every k-th published version is a full snapshot, the others deltas (XOR + zstd) on "
        "the previous one; 1: every version full",
    )

    @field_validator("publish_uri")
    @classmethod
    def _object_store(cls, uri: str | None) -> str | None:
        """The scheme only: the bucket's name, credentials and reach are `storage.preflight`'s, before the run starts."""
        if uri is not None and not re.fullmatch(r"(gs|s3)://[^/]+(/.*)?", uri):
            raise ValueError(f"{uri!r}: expected gs://BUCKET/PREFIX or s3://BUCKET/PREFIX (null: publish under run_dir/versions)")
        return uri

    @model_validator(mode="before")
    @classmethod
    def _aggregation_from_estimator(cls, data: object) -> object:
        """An unset aggregation is the estimator's: Dr.GRPO's constant normaliser, else token_mean."""
        if isinstance(data, dict) and data.get("aggregation") is None:
            data = {**data, "aggregation": "constant" if data.get("estimator") == "dr_grpo" else "token_mean"}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> "RLSettings":
        problems = []
        if self.estimator == "dr_grpo" and self.aggregation != "constant":
            problems.append((
                "aggregation",
                f"estimator dr_grpo needs aggregation constant, got {self.aggregation}: Dr.GRPO's loss divides by a "
                "constant, not by rollout or batch lengths (leave aggregation out to get it)",
            ))
        if self.aggregation == "constant" and self.estimator != "dr_grpo":
            problems.append((
                "estimator",
                f"aggregation constant is Dr.GRPO's normaliser, but estimator is {self.estimator}: set estimator: "
                "dr_grpo (and advantages.estimator: dr_grpo in the ETL config) or another aggregation",
            ))
        if self.aggregation == "constant" and self.max_generation_tokens is None:
            problems.append(("max_generation_tokens", "aggregation constant needs it: the sampler's generation budget"))
        if self.estimator != "dr_grpo" and self.aggregation != "constant" and self.max_generation_tokens is not None:
            problems.append(
                ("max_generation_tokens", f"only aggregation constant (dr_grpo) uses it, aggregation is {self.aggregation}")
            )
        if self.alpha >= self.beta:
            problems.append(f"alpha {self.alpha} must be below beta {self.beta}")
        if self.initial_policy_version + self.steps > MAX_POLICY_VERSION:
            problems.append(
                f"initial_policy_version + steps exceeds {MAX_POLICY_VERSION:,}, the largest int64 policy version "
                "a TrainBatch or policy announcement can carry"
            )
        if self.full_every_k > self.keep_versions:
            problems.append((
                "keep_versions",
                f"{self.keep_versions} is below full_every_k {self.full_every_k}: a delta's chain back to its full "
                "snapshot would be removed before a late sampler could rebuild it",
            ))
        if self.publish_interval is not None and (not self.save_interval or self.publish_interval % self.save_interval):
            saves = f"every {self.save_interval} steps" if self.save_interval else "only at the end: save_interval 0"
            problems.append((
                "publish_interval",
                f"{self.publish_interval} announces versions that are not checkpointed (saves happen "
                f"{saves}): a restart would retrain them with other weights. Set publish_interval to a multiple of "
                "save_interval, or null to announce every checkpoint",
            ))
        configs.check(problems)
        return self

    def announces(self, step: int) -> bool:
        """Whether the version reached at `step` is announced (besides the run's first and last)."""
        interval = self.publish_interval or self.save_interval
        return interval > 0 and step % interval == 0


class RLConfig(RunDirectory, StrictModel):
    run_dir: Path = Field(description="checkpoints/, metrics.jsonl are written here")
    init_checkpoint: Path | None = Field(
        default=None, description="a midtrain/RL checkpoint directory (step_*) whose model weights start the run"
    )
    model: ModelConfig
    moe: MoEConfig
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig
    rollouts: RolloutsConfig
    rl: RLSettings

    @property
    def versions_dir(self) -> Path:
        """Announced policy versions, exported as Hugging Face safetensors (version_<N>/)."""
        return self.run_dir / "versions"

    @model_validator(mode="after")
    def _layout(self) -> "RLConfig":
        p = self.parallel
        problems = memory_problems(self.model, self.moe, self.parallel, tokens=0)
        if (p.tensor, p.pipeline) != (1, 1):
            problems.append((
                "parallel", "the RL step runs each batch share as one micro-batch through the whole model: "
                "tensor and pipeline must be 1 (data- and expert-parallel ranks are supported)",
            ))
        if p.expert > 1 and self.moe.token_dispatcher == "allgather":
            problems.append((
                "moe.token_dispatcher", "expert-parallel RL needs alltoall or flex: each rank's share of a batch has "
                "its own token count, which the allgather dispatcher cannot exchange",
            ))
        configs.check(problems)
        return self


def parse_rl_config(data: dict, base: Path, where: str = "config") -> RLConfig:
    data = dict(data)
    for key in ("run_dir", "init_checkpoint"):
        if isinstance(data.get(key), str):
            data[key] = str((base / data[key]).resolve())
    return configs.validate(RLConfig, data, where, MidtrainConfigError)


def load_rl_config(path: str | Path) -> RLConfig:
    path = Path(path)
    data = configs.read_yaml_mapping(path, MidtrainConfigError, sections="model, moe, rollouts, rl, ...")
    return parse_rl_config(data, path.resolve().parent, str(path))
