"""`ember export megatron --blend`: a shard set's sources as a Megatron blend.

Each source's rows become their own `.bin/.idx` (`OUT_PREFIX.<source>`, one sequence per row, as in sequences
mode; packing never puts two sources in one row), and the blend is written twice, in the two forms Megatron
reads: `OUT_PREFIX.data-path.txt`, the `--data-path` list `weight prefix weight prefix ...` (pass its words to
--data-path, or the file to --data-args-path), and `OUT_PREFIX.per-split.json` for --per-split-data-args-path
(the train split; valid and test are null: they come from a shard set of their own).

A source's weight is its configured mixture weight, so Megatron's BlendedDataset draws each source in that
share; when ember already resampled the sources to token budgets (the manifest records `mixture`), the shards
hold the mixture and the weight is the source's share of the tokens written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ember.schemas import Manifest
from ember.tokenize.megatron_export import ExportError, index_bytes, verified_batches, verified_set
from ember.tokenize.shardset import ShardVerifier

DATA_PATH_SUFFIX = ".data-path.txt"
PER_SPLIT_SUFFIX = ".per-split.json"


@dataclass(frozen=True)
class BlendResult:
    prefixes: dict[str, Path]  # source -> its .bin/.idx prefix
    weights: dict[str, float]
    sequences: dict[str, int]
    data_path: Path
    per_split: Path


def blend_weights(manifest: Manifest) -> dict[str, float]:
    """Each source's weight, normalised to sum to 1 over the sources with rows (see the module docstring)."""
    resampled = bool(manifest.model_extra.get("mixture"))
    raw = {name: float(s.tokens if resampled else s.mixture_weight) for name, s in manifest.sources.items() if s.sequences}
    total = sum(raw.values())
    if total <= 0:
        raise ExportError("every source with rows has weight 0; a blend needs one weighted source")
    return {name: w / total for name, w in raw.items() if w > 0}


def export_blend(shards_dir: str | Path, out_prefix: str | Path, verifier: ShardVerifier | None = None) -> BlendResult:
    shards_dir, out_prefix = Path(shards_dir), Path(out_prefix)
    manifest, dtype = verified_set(shards_dir, verifier)
    weights = blend_weights(manifest)
    prefixes = {name: out_prefix.with_name(f"{out_prefix.name}.{name}") for name in weights}
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary = {name: p.with_name(f".{p.name}.bin.tmp") for name, p in prefixes.items()}
    rows = dict.fromkeys(weights, 0)
    handles = {name: open(path, "wb") for name, path in temporary.items()}
    try:
        for entry in manifest.shards:
            for batch, tokens, _first in verified_batches(shards_dir / entry.path, entry.rows, manifest):
                names = np.asarray(batch.column("source").to_pylist())
                for name, handle in handles.items():
                    mine = tokens[names == name]
                    handle.write(mine.astype(dtype).tobytes())
                    rows[name] += len(mine)
        for handle in handles.values():
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        raise
    finally:
        for handle in handles.values():
            handle.close()
    for name, prefix in prefixes.items():
        idx = prefix.with_name(f"{prefix.name}.idx")
        idx_tmp = idx.with_name(f".{idx.name}.tmp")
        idx_tmp.write_bytes(index_bytes(np.full(rows[name], manifest.seq_len, dtype=np.int32), dtype))
        os.replace(temporary[name], prefix.with_name(f"{prefix.name}.bin"))
        os.replace(idx_tmp, idx)
    blend = [word for name in weights for word in (f"{weights[name]:.6g}", str(prefixes[name].resolve()))]
    data_path = out_prefix.with_name(out_prefix.name + DATA_PATH_SUFFIX)
    per_split = out_prefix.with_name(out_prefix.name + PER_SPLIT_SUFFIX)
    data_path.write_text(" ".join(blend) + "\n", encoding="utf-8")
    per_split.write_text(json.dumps({"train": blend, "valid": None, "test": None}, indent=1) + "\n", encoding="utf-8")
    return BlendResult(prefixes, weights, rows, data_path, per_split)
