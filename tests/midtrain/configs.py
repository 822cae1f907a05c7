"""Tiny trainer configs for the tests (seq_len 32, 2 layers, 4 experts) written next to their shards."""

from __future__ import annotations

from pathlib import Path

import yaml

from ember.pipelines.corpus.build import build_corpus
from ember.pipelines.corpus.config import parse_config
from ember.demo.sample_corpus import write_sample_corpus
from ember.schemas import read_manifest

from .shardsets import TOKENIZER, packed_rows, write_shard_set

SEQ = 32


def tiny_run(root: Path, *, steps: int, save_interval: int, parallel: dict | None = None, **moe) -> Path:
    """Two shard sets (code 0.7, web 0.3) and a config training `steps` steps of 8 samples."""
    write_shard_set(root / "code", packed_rows(160, SEQ, 1, "code", with_loss_mask=True), seq_len=SEQ, rows_per_shard=64, rows_per_batch=16)
    write_shard_set(root / "web", packed_rows(96, SEQ, 2, "web"), seq_len=SEQ, rows_per_shard=96, rows_per_batch=16)
    return _write(root, TOKENIZER["name"], TOKENIZER["vocab_size"], [("code", 0.7), ("web", 0.3)], steps, save_interval, parallel, moe)


def corpus_run(root: Path, tokenizer: Path, *, steps: int, save_interval: int) -> Path:
    """Shards that `ember corpus build` made from raw code + web input (the sample corpus, tokenize
    stage on), and a config training `steps` steps of 8 samples on them."""
    sample = write_sample_corpus(root / "input")
    settings = sample.config(str(root / "corpus"))
    settings["tokenize"] = {
        "seq_len": SEQ, "sequences_per_shard": 64, "rows_per_batch": 16, "window_documents": 16,
        "tokenizer": {"kind": "huggingface", "path": str(tokenizer), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
    }
    build_corpus(parse_config(settings), ["--runner=FnApiRunner"])
    manifest = read_manifest(root / "corpus" / "shards")
    return _write(root, manifest.tokenizer.name, manifest.tokenizer.vocab_size, [("corpus/shards", 1.0)], steps, save_interval, None, {})


def _write(root: Path, tokenizer: str, vocab_size: int, shard_sets: list[tuple[str, float]], steps: int, save_interval: int,
           parallel: dict | None, moe: dict) -> Path:
    config = {
        "run_dir": "run",
        "model": {
            "tokenizer": tokenizer, "vocab_size": vocab_size, "seq_len": SEQ,
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        },
        "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 128, "aux_loss_coeff": 0.01, **moe},
        "parallel": parallel or {},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 1, "decay_steps": 2},
        "data": {
            "shard_sets": [{"path": path, "weight": weight} for path, weight in shard_sets],
            "blend_period": 10, "shuffle_window_chunks": 2, "num_workers": 0,
        },
        "train": {"steps": steps, "micro_batch_size": 2, "global_batch_size": 8, "save_interval": save_interval},
    }
    path = root / "midtrain.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
