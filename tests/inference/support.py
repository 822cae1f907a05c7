"""Tiny exported policies for the sampler tests, in the tiny RL example's shape (ember/midtrain/examples/rl_tiny_cpu.yaml).

Each is written by the real exporter (`export_checkpoint`) from a real torch.distributed checkpoint holding
megatron's tensor names at their global shapes (what `midtrain rl` saves), without megatron or a process group,
so a version takes well under a second; a later version is the same tensors moved by a seeded step.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import yaml

from ember.midtrain.config import ModelConfig, MoEConfig
from ember.midtrain.export_hf import Exported, export_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "ember" / "midtrain" / "examples" / "rl_tiny_cpu.yaml"


def example_shape() -> tuple[ModelConfig, MoEConfig]:
    data = yaml.safe_load(EXAMPLE.read_text())
    return ModelConfig(**data["model"]), MoEConfig(**data["moe"])


def _megatron_tensors(model: ModelConfig, moe: MoEConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layers, hidden, experts, ffn = model.num_layers, model.hidden_size, moe.num_experts, moe.ffn_hidden_size
    rows = -(-model.vocab_size // model.vocab_pad_multiple) * model.vocab_pad_multiple
    groups = model.num_query_groups or model.num_attention_heads
    qkv_rows = (model.num_attention_heads + 2 * groups) * (hidden // model.num_attention_heads)
    shapes = {
        "embedding.word_embeddings.weight": (rows, hidden),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, qkv_rows, hidden),
        "decoder.layers.self_attention.linear_proj.weight": (layers, hidden, hidden),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, hidden),
        "decoder.layers.mlp.router.weight": (layers, experts, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (layers, experts, 2 * ffn, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (layers, experts, hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
        "output_layer.weight": (rows, hidden),
    }
    tensors = {name: torch.randn(shape, generator=g) * 0.15 for name, shape in shapes.items()}
    for name in shapes:
        if "norm" in name:
            tensors[name] += 1.0  # RMSNorm scales start at one, as megatron initialises them
    return tensors


def export_version(root: Path, version: int, seed: int = 1) -> Exported:
    """root/version_N: an export of the example-shaped policy, its tensors drawn from `seed`, stamped `version`."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as save_checkpoint

    model, moe = example_shape()
    checkpoint = root / f"step_{version:08d}"
    with warnings.catch_warnings():  # "torch.distributed is disabled ... a single process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        save_checkpoint(_megatron_tensors(model, moe, seed), storage_writer=FileSystemWriter(str(checkpoint)), no_dist=True)
    return export_checkpoint(checkpoint, root / f"version_{version}", model, moe, {"policy_version": version, "step": version})


def consecutive_checkpoints(root: Path, count: int, *, seed: int = 1, lr: float = 1e-5, model: ModelConfig | None = None,
                            moe: MoEConfig | None = None) -> list[Path]:
    """root/step_1 .. step_COUNT: the example-shaped policy (or `model`/`moe`) moved between checkpoints by an
    Adam-like step (every weight by +-lr, the sign drawn from `seed`), as consecutive RL versions differ."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as save_checkpoint

    if model is None or moe is None:
        model, moe = example_shape()
    tensors, g, paths = _megatron_tensors(model, moe, seed), torch.Generator().manual_seed(seed + 1), []
    for step in range(1, count + 1):
        if step > 1:
            tensors = {name: t + lr * torch.randint(0, 2, t.shape, generator=g).mul(2).sub(1) for name, t in tensors.items()}
        paths.append(root / f"step_{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            save_checkpoint(tensors, storage_writer=FileSystemWriter(str(paths[-1])), no_dist=True)
    return paths
