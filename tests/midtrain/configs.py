"""Tiny trainer configs for the tests (seq_len 32, 2 layers, 4 experts) written next to their shards."""

from __future__ import annotations

from pathlib import Path

import yaml

from .shardsets import TOKENIZER, packed_rows, write_shard_set

SEQ = 32


def tiny_run(root: Path, *, steps: int, save_interval: int, parallel: dict | None = None, **moe) -> Path:
    """Two shard sets (code 0.7, web 0.3) and a config training `steps` steps of 8 samples."""
    write_shard_set(root / "code", packed_rows(160, SEQ, 1, "code", with_loss_mask=True), seq_len=SEQ, rows_per_shard=64, rows_per_batch=16)
    write_shard_set(root / "web", packed_rows(96, SEQ, 2, "web"), seq_len=SEQ, rows_per_shard=96, rows_per_batch=16)
    config = {
        "run_dir": "run",
        "model": {
            "tokenizer": TOKENIZER["name"], "vocab_size": TOKENIZER["vocab_size"], "seq_len": SEQ,
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        },
        "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 128, "aux_loss_coeff": 0.01, **moe},
        "parallel": parallel or {},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 1, "decay_steps": 2},
        "data": {
            "shard_sets": [{"path": "code", "weight": 0.7}, {"path": "web", "weight": 0.3}],
            "blend_period": 10, "shuffle_window_chunks": 2, "num_workers": 0,
        },
        "train": {"steps": steps, "micro_batch_size": 2, "global_batch_size": 8, "save_interval": save_interval},
    }
    path = root / "midtrain.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
