"""`midtrain export-hf CHECKPOINT --out DIR`: a checkpoint's policy as Hugging Face-style safetensors + config.json.

The policy ember builds (megatron-core GPT, RMSNorm, RoPE, SwiGLU experts, softmax top-k router without
shared experts) is Mixtral's architecture, so the export is a `MixtralForCausalLM` directory an inference
server loads as is. It is read from the checkpoint's files (torch.distributed.checkpoint, no process
group), where megatron stores every tensor at its global shape: the export is the same whatever tensor,
expert or data parallel layout wrote the checkpoint.

Names (megatron checkpoint key, layer l and expert e taken from the stacked leading dimensions -> HF):

    embedding.word_embeddings.weight                       -> model.embed_tokens.weight
    decoder.layers.self_attention.linear_qkv.layer_norm_weight[l] -> model.layers.l.input_layernorm.weight
    decoder.layers.self_attention.linear_qkv.weight[l]     -> model.layers.l.self_attn.{q,k,v}_proj.weight
        (megatron interleaves per query group [q heads of the group, k, v]; split into the three)
    decoder.layers.self_attention.linear_proj.weight[l]    -> model.layers.l.self_attn.o_proj.weight
    decoder.layers.mlp.linear_fc1.layer_norm_weight[l]     -> model.layers.l.post_attention_layernorm.weight
    decoder.layers.mlp.router.weight[l]                    -> model.layers.l.block_sparse_moe.gate.weight
    decoder.layers.mlp.experts.experts.linear_fc1.weight[l, e] = [gate; up]
                                                           -> model.layers.l.block_sparse_moe.experts.e.{w1, w3}.weight
    decoder.layers.mlp.experts.experts.linear_fc2.weight[l, e] -> model.layers.l.block_sparse_moe.experts.e.w2.weight
    decoder.final_layernorm.weight                         -> model.norm.weight
    output_layer.weight                                    -> lm_head.weight

`vocab_size` in config.json is the embedding's rows (the tokenizer's vocabulary padded, see
`model.padded_vocab_size`); the tokenizer's name and real size are under `ember`. The directory appears
complete or not at all (written under a temporary name, every file fsync'd, renamed, parent fsync'd);
`export.json` pins every file by sha256 and size, and its own sha256 is the digest a policy announcement
carries (`export_format`, which also holds the one reader). config.json is validated by that reader's
`PolicyConfig` before it is written, so an export ember writes is one ember loads.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import ValidationError

from ember.configs import error_lines
from ember.midtrain.config import ModelConfig, MoEConfig
from ember.midtrain.export_format import CONFIG_FILE, WEIGHTS_FILE, PolicyConfig, seal

RMS_NORM_EPS = 1e-5
"""megatron's TransformerConfig.layernorm_epsilon default, which ember's model config does not change."""

_PREFIX = "decoder.layers."
_KEYS = {
    "embed": "embedding.word_embeddings.weight",
    "input_norm": _PREFIX + "self_attention.linear_qkv.layer_norm_weight",
    "qkv": _PREFIX + "self_attention.linear_qkv.weight",
    "proj": _PREFIX + "self_attention.linear_proj.weight",
    "mlp_norm": _PREFIX + "mlp.linear_fc1.layer_norm_weight",
    "router": _PREFIX + "mlp.router.weight",
    "fc1": _PREFIX + "mlp.experts.experts.linear_fc1.weight",
    "fc2": _PREFIX + "mlp.experts.experts.linear_fc2.weight",
    "final_norm": "decoder.final_layernorm.weight",
    "output": "output_layer.weight",
}


class ExportError(ValueError):
    """The checkpoint cannot be exported (missing, another architecture, or the output exists)."""


@dataclass(frozen=True)
class Exported:
    path: Path
    sha256: str  # of its export.json, which pins every file: what an announcement carries

    @property
    def uri(self) -> str:
        return self.path.resolve().as_uri()


def architecture_record(model: ModelConfig, moe: MoEConfig) -> dict[str, Any]:
    """What a checkpoint records so it can be exported without its run config."""
    return {"model": model.model_dump(mode="json"), "moe": moe.model_dump(mode="json")}


def architecture_from_record(record: dict[str, Any]) -> tuple[ModelConfig, MoEConfig]:
    return ModelConfig.model_validate(record["model"]), MoEConfig.model_validate(record["moe"])


def unsupported(model: ModelConfig, moe: MoEConfig) -> list[str]:
    """What of this architecture Mixtral cannot express (empty: exportable)."""
    found = []
    if not model.swiglu:
        found.append("model.swiglu false (Mixtral experts are SwiGLU)")
    if model.normalization != "RMSNorm":
        found.append(f"model.normalization {model.normalization} (Mixtral uses RMSNorm)")
    if model.position_embedding != "rope":
        found.append(f"model.position_embedding {model.position_embedding} (Mixtral uses RoPE)")
    if moe.shared_expert_ffn_hidden_size is not None:
        found.append("moe.shared_expert_ffn_hidden_size (Mixtral has no shared expert)")
    if moe.router_score_function != "softmax" or moe.expert_bias:
        found.append("a sigmoid router / expert bias (Mixtral routes by softmax over the top-k logits)")
    return found


# megatron stores a checkpoint's common (non-tensor) state as this one ShardedObject of the torch_dist files
# (`dist_checkpointing.load_common_state_dict`); read here without importing megatron.
_COMMON_KEY = "common_state/shard_0_1"


def _load(checkpoint: Path, state: dict) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load

    with warnings.catch_warnings():  # "no process group: assuming a single process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        load(state, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)


def _metadata(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    if not (checkpoint / ".metadata").is_file():
        raise ExportError(f"{checkpoint} is not a megatron dist checkpoint (no .metadata); pass a step_* directory")
    return FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata


def read_checkpoint_common(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's common state (train step, layout, `extra`), as megatron saved it."""
    if _COMMON_KEY not in _metadata(checkpoint):
        raise ExportError(f"{checkpoint} has no common state: not written by megatron's torch_dist checkpointing")
    state: dict[str, Any] = {_COMMON_KEY: io.BytesIO()}
    _load(checkpoint, state)
    loaded = state[_COMMON_KEY]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def read_checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a megatron dist checkpoint at their global shapes, read in this one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _metadata(checkpoint)
    missing = [key for key in _KEYS.values() if not isinstance(stored.get(key), TensorStorageMetadata)]
    if missing:
        extra = sorted(k for k in stored if k.startswith(_PREFIX) and "optimizer" not in k and "_extra_state" not in k)
        raise ExportError(
            f"{checkpoint} lacks {', '.join(missing)}: not the MoE GPT ember builds (it has {', '.join(extra[:6])} ...)"
        )
    tensors = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype) for key in _KEYS.values()}
    _load(checkpoint, tensors)
    return tensors


def hf_tensors(tensors: dict[str, torch.Tensor], model: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """megatron's tensors under Mixtral's names (see the module docstring)."""
    t = {name: tensors[key] for name, key in _KEYS.items()}
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    head_dim, per_group = model.hidden_size // heads, heads // groups
    layers, experts = t["qkv"].shape[0], t["fc1"].shape[1]
    if (layers, experts) != (model.num_layers, moe.num_experts):
        raise ExportError(
            f"the checkpoint holds {layers} layers x {experts} experts, the architecture says "
            f"{model.num_layers} x {moe.num_experts}: the config is not the one this checkpoint was trained with"
        )
    out = {
        "model.embed_tokens.weight": t["embed"],
        "model.norm.weight": t["final_norm"],
        "lm_head.weight": t["output"],
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        qkv = t["qkv"][layer].reshape(groups, (per_group + 2) * head_dim, model.hidden_size)
        q, k, v = qkv.split([per_group * head_dim, head_dim, head_dim], dim=1)
        out[prefix + "self_attn.q_proj.weight"] = q.reshape(heads * head_dim, model.hidden_size)
        out[prefix + "self_attn.k_proj.weight"] = k.reshape(groups * head_dim, model.hidden_size)
        out[prefix + "self_attn.v_proj.weight"] = v.reshape(groups * head_dim, model.hidden_size)
        out[prefix + "self_attn.o_proj.weight"] = t["proj"][layer]
        out[prefix + "input_layernorm.weight"] = t["input_norm"][layer]
        out[prefix + "post_attention_layernorm.weight"] = t["mlp_norm"][layer]
        out[prefix + "block_sparse_moe.gate.weight"] = t["router"][layer]
        for expert in range(experts):
            gate, up = t["fc1"][layer, expert].chunk(2, dim=0)
            moe_prefix = f"{prefix}block_sparse_moe.experts.{expert}."
            out[moe_prefix + "w1.weight"] = gate
            out[moe_prefix + "w3.weight"] = up
            out[moe_prefix + "w2.weight"] = t["fc2"][layer, expert]
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def hf_config(model: ModelConfig, moe: MoEConfig, vocab_rows: int, dtype: torch.dtype) -> dict[str, Any]:
    heads = model.num_attention_heads
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab_rows,
        "hidden_size": model.hidden_size,
        "intermediate_size": moe.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.num_query_groups or heads,
        "head_dim": model.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": float(model.rotary_base),
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.router_topk,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "initializer_range": model.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "ember": {"tokenizer": model.tokenizer, "tokenizer_vocab_size": model.vocab_size},
    }


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_files(checkpoint: Path, model: ModelConfig, moe: MoEConfig) -> dict[str, bytes]:
    """config.json and model.safetensors of `checkpoint`'s policy, in memory (a delta export keeps the second)."""
    from safetensors.torch import save

    problems = unsupported(model, moe)
    if problems:
        raise ExportError(f"{checkpoint}: cannot be written as MixtralForCausalLM: {'; '.join(problems)}")
    tensors = hf_tensors(read_checkpoint_tensors(checkpoint), model, moe)
    vocab_rows, dtype = tensors["model.embed_tokens.weight"].shape[0], tensors["model.embed_tokens.weight"].dtype
    try:
        config = PolicyConfig.model_validate(hf_config(model, moe, vocab_rows, dtype))
    except ValidationError as exc:
        raise ExportError(f"{checkpoint}: its {CONFIG_FILE} would not load: {'; '.join(error_lines(exc))}") from None
    return {
        WEIGHTS_FILE: save(tensors, metadata={"format": "pt"}),
        CONFIG_FILE: (json.dumps(config.model_dump(mode="json"), indent=2) + "\n").encode(),
    }


def write_export(out: Path, seal_into: Callable[[Path], str]) -> Exported:
    """`out` (which must not exist) appears complete or not at all: `seal_into` writes the files and the manifest
    into a temporary sibling and returns the digest, which is then renamed into place."""
    if out.exists():
        raise ExportError(f"{out} exists; export into a new directory (an export is never overwritten in place)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        digest = seal_into(tmp)
        os.chmod(tmp, 0o755)
        _fsync(tmp)
        os.rename(tmp, out)
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, digest)


def export_checkpoint(
    checkpoint: Path, out: Path, model: ModelConfig, moe: MoEConfig, provenance: dict[str, int] | None = None
) -> Exported:
    """Writes `out` (which must not exist) from `checkpoint`; returns its path and digest (`Exported`).
    `provenance` (policy_version, step) goes into the manifest."""
    if out.exists():
        raise ExportError(f"{out} exists; export into a new directory (an export is never overwritten in place)")
    files = export_files(checkpoint, model, moe)
    return write_export(out, lambda tmp: seal(tmp, files, checkpoint, **(provenance or {})))
