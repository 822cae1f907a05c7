"""The mid-training stage of `ember demo`: a few CPU steps of a tiny MoE GPTModel on a shard set.

The model is sized from the shard set's manifest (tokenizer, vocab, seq_len), so the demo trains on
exactly what `ember corpus build` wrote. It runs `python -m ember.midtrain.train` in a subprocess:
megatron-core's global parallel state must not live in the demo's own process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from rich.console import Console

from ember.schemas import read_manifest

DEMO_STEPS = 4


def demo_config(shards_dir: Path, workdir: Path) -> Path:
    manifest = read_manifest(shards_dir)
    config = {
        "run_dir": str(workdir / "run"),
        "model": {
            "tokenizer": manifest.tokenizer.name,
            "vocab_size": manifest.tokenizer.vocab_size,
            "seq_len": manifest.seq_len,
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
        },
        "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 128, "aux_loss_coeff": 0.01},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 1, "decay_steps": 1},
        "data": {"shard_sets": [{"path": str(shards_dir)}], "num_workers": 0, "blend_period": 1},
        "train": {"steps": DEMO_STEPS, "micro_batch_size": 1, "global_batch_size": 2},
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "midtrain.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(console: Console, shards_dir: Path, workdir: Path) -> list[tuple[str, str]]:
    """Trains DEMO_STEPS steps on CPU and returns summary rows (loss per step among them)."""
    config = demo_config(Path(shards_dir), Path(workdir))
    with console.status(f"mid-training a tiny MoE GPTModel for {DEMO_STEPS} steps on CPU..."):
        result = subprocess.run(
            [sys.executable, "-m", "ember.midtrain.train", str(config)], capture_output=True, text=True, timeout=900
        )
    if result.returncode != 0:
        raise RuntimeError(f"midtrain train {config} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (Path(workdir) / "run" / "metrics.jsonl").read_text().splitlines()]
    manifest = read_manifest(shards_dir)
    return [
        ("midtrain model", f"GPTModel 2 layers x 4 experts (top-2), vocab {manifest.tokenizer.vocab_size}, seq_len {manifest.seq_len}"),
        ("midtrain loss per step", " -> ".join(f"{r['loss']:.3f}" for r in records)),
        ("midtrain tokens/s", f"{records[-1]['tokens_per_s']:.0f} (CPU, last step)"),
        ("midtrain tokens per expert (layer 1, last step)", str(records[-1]["tokens_per_expert"][0])),
        ("midtrain checkpoint", str(Path(workdir) / "run" / "checkpoints")),
    ]
