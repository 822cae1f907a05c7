"""Megatron export: `ember export megatron` (rows, and --documents) vs megatron-core's own builder.

One synthetic shard set: --documents documents of long-tailed lengths (random ids below a 50k
vocabulary, uint16, each ending with an EOS id as ember frames them), best-fit packed into rows of
--seq-len tokens, the rows shuffled over shards of 256 rows as ember's global shuffle leaves them
(so split documents' pieces are scattered). In one run, medians over --repeats:

- anchor: megatron-core's `IndexedDatasetBuilder` writing the same documents from memory, one
  `add_document` each - the write half of `preprocess_data.py`, with the documents already whole;
- ember rows: one Megatron sequence per packed row (the default mode);
- ember documents: `--documents`, rebuilding every document from the rows' provenance.

The documents export must equal the anchor's files byte for byte (same documents, same order);
that is checked, timing is only reported.

    .venv/bin/python bench/bench_megatron_export.py [--documents 20000] [--seq-len 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.schemas import Manifest, write_manifest  # noqa: E402
from ember.tokenize.megatron_export import export_megatron  # noqa: E402
from ember.tokenize.packing import Segment, assemble, best_fit_decreasing  # noqa: E402
from ember.tokenize.shards import ShardRow, write_shard  # noqa: E402
from ember.tokenize.shardset import ShardVerifier  # noqa: E402

VOCAB = 50_000
EOS = VOCAB - 2
PAD = VOCAB - 1
ROWS_PER_SHARD = 256


def synthetic_documents(n: int, seq_len: int, seed: int) -> list[np.ndarray]:
    """Long-tailed lengths (log-normal, median ~seq_len/4, a tail past several rows), EOS-terminated."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(seq_len / 4), 1.2, size=n).astype(int), 2, 20 * seq_len)
    return [np.append(rng.integers(0, EOS, size=k - 1, dtype=np.uint32), np.uint32(EOS)) for k in lengths]


def write_set(directory: Path, docs: list[np.ndarray], seq_len: int, seed: int) -> list[ShardRow]:
    packing = best_fit_decreasing([len(d) for d in docs], seq_len)
    rows = [
        ShardRow(assemble([Segment(f"doc{p.doc}", p.start, p.end, docs[p.doc][p.start : p.end]) for p in pieces], seq_len, PAD), "code")
        for pieces in packing.bins
    ]
    rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
    directory.mkdir(parents=True)
    entries = [
        write_shard(directory, i, rows[start : start + ROWS_PER_SHARD], rows_per_batch=16)
        for i, start in enumerate(range(0, len(rows), ROWS_PER_SHARD))
    ]
    tokens = sum(len(d) for d in docs)
    padding = len(rows) * seq_len - tokens
    write_manifest(directory, Manifest(
        tokenizer={"name": "synthetic", "hash": "b" * 16, "vocab_size": VOCAB}, seq_len=seq_len, dtype="uint16",
        sources={"code": {"documents": len(docs), "tokens": tokens, "sequences": len(rows), "padding_tokens": padding}},
        padding_tokens=padding, pad_token_id=PAD, shards=entries, config_hash="0123456789ab",
        created_at="2026-12-03T00:00:00Z", framing={"eos_token_id": EOS},
    ))
    return rows


def megatron_builder(prefix: Path, docs: list[np.ndarray]) -> None:
    import torch  # imported by main before any timing
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def median_seconds(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function; they take turns within each repeat, so load on the shared machine hits
    each alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=None, help="default: quick 3000, full 20000")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.documents = args.documents or profile_default(args.profile, 3000, 20_000)
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (torch and megatron-core load outside the timings)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        docs = synthetic_documents(args.documents, args.seq_len, seed=1)
        rows = write_set(root / "set", docs, args.seq_len, seed=2)
        order = [int(s["document_id"][3:]) for r in rows for s in r.row.segments if s["doc_token_start"] == 0]
        ordered = [docs[i] for i in order]
        verifier = ShardVerifier(root / "markers")
        export_megatron(root / "set", root / "warm", verifier)  # shards hashed once; every timed run skips that
        split = sum(1 for d in docs if len(d) > args.seq_len)
        tokens = sum(len(d) for d in docs)
        print(f"{len(docs):,} documents ({split:,} split), {tokens:,} tokens, {len(rows):,} rows of {args.seq_len}, "
              f"{-(-len(rows) // ROWS_PER_SHARD)} shards; medians of {args.repeats}")
        timed = median_seconds({
            "anchor": lambda: megatron_builder(root / "anchor", ordered),
            "rows": lambda: export_megatron(root / "set", root / "rows", verifier),
            "docs": lambda: export_megatron(root / "set", root / "docs", verifier, documents=True),
        }, args.repeats)
        anchor, by_row, by_doc = timed["anchor"], timed["rows"], timed["docs"]
        same = {}
        for suffix in (".bin", ".idx"):
            same[suffix] = (root / f"docs{suffix}").read_bytes() == (root / f"anchor{suffix}").read_bytes()
            print(f"documents{suffix} equals megatron-core's: {same[suffix]}")
        print("| mode | s | M tokens/s | vs anchor |")
        print("|---|---|---|---|")
        for label, seconds in (("megatron-core IndexedDatasetBuilder (anchor)", anchor), ("ember rows", by_row),
                               ("ember --documents", by_doc)):
            print(f"| {label} | {seconds:.3f} | {tokens / seconds / 1e6:.1f} | {anchor / seconds:.2f}x |")
        write_results(args.results, "bench_megatron_export", args.profile, [
            Figure(f"M tokens/s, {what}", "M tokens/s", tokens / seconds / 1e6, tokens / anchor / 1e6,
                   "megatron-core IndexedDatasetBuilder", repeats=args.repeats)
            for what, seconds in (("rows", by_row), ("--documents", by_doc))
        ], documents=args.documents, seq_len=args.seq_len, tokens=tokens, bytes_equal_anchor=same)


if __name__ == "__main__":
    main()
