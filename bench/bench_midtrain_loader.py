"""Mid-training loader: ember's Arrow shard dataset vs megatron-core GPTDataset on the same tokens.

For each size N (default 10^3, 10^5, 10^6 sequences of --seq-len tokens) it writes two shard sets
(70% / 30% of N, zstd Arrow IPC, PACKED_SEQUENCE_SCHEMA, two documents per row) and the same rows
as Megatron `.bin/.idx` with megatron-core's own `IndexedDatasetBuilder` (one sequence = one
document, so a Megatron sample of seq_len tokens is one stored row). Then, in one run:

- startup: constructing the blended dataset. ember reads manifests and shard footers; Megatron
  builds (cold: empty cache dir) or loads (cached) its document/sample/shuffle/blend indices with
  `BlendedMegatronDatasetBuilder(GPTDataset, ...)`, blend weights 0.7/0.3, one epoch of samples.
- read+collate: --samples samples in each dataset's own (shuffled, blended) order through a
  `DataLoader(batch_size=8, num_workers=0)`, with block-diagonal attention masks and reset
  position ids on both sides (ember from cu_seqlens, Megatron from EOD tokens).
- shuffle scope: the two orders differ. ember's is window-local (rows shuffled within windows of
  64 record batches of 128 rows, the windows in shuffled order: each decoded record batch serves
  its 128 rows from a cache), megatron-core's is a global permutation of samples over a memory-
  mapped .bin. So ember is also read in a global order: the same dataset at positions drawn by a
  seeded permutation of all N (every sample then lands in an almost surely uncached record batch).

Medians over --repeats, ratios ember/megatron. Files are in the page cache for both (just
written). Timing is reported, never asserted.

    .venv/bin/python bench/bench_midtrain_loader.py [--sizes 1000 100000 1000000] [--samples 20000]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from ember.midtrain.data import MidtrainDataset, ShardSetSpec
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, write_manifest
from ember.tokenize.shards import ROWS_PER_BATCH_KEY
from ember.tokenize.shardset import file_sha256

VOCAB = 32000
ROWS_PER_BATCH = 128
ROWS_PER_SHARD = 65536
BATCH = 8


def synthetic_rows(n: int, seq_len: int, seed: int, source: str) -> pa.Table:
    """n packed rows of random tokens, each two documents split at a random point."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(n, seq_len), dtype=np.uint32)
    split = rng.integers(seq_len // 8, seq_len - seq_len // 8, size=n).astype(np.int32)
    cu = np.stack([np.zeros(n, np.int32), split, np.full(n, seq_len, np.int32)], axis=1)
    tokens[np.arange(n), split - 1] = VOCAB - 1  # an EOD where each first document ends (for Megatron)
    tokens[:, -1] = VOCAB - 1
    starts = np.zeros(2 * n, np.int64)
    ends = np.stack([split, seq_len - split], axis=1).reshape(-1).astype(np.int64)
    ids = pa.array([f"{source}-{i // 2}-{i % 2}" for i in range(2 * n)], pa.string())
    segments = pa.ListArray.from_arrays(
        pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)),
        pa.StructArray.from_arrays([ids, pa.array(starts), pa.array(ends)], fields=list(PACKED_SEQUENCE_SCHEMA.field("segments").type.value_type)),
    )
    return pa.Table.from_arrays(
        [
            pa.ListArray.from_arrays(pa.array(np.arange(0, n * seq_len + 1, seq_len, dtype=np.int32)), pa.array(tokens.reshape(-1))),
            pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)), pa.array(cu.reshape(-1))),
            segments,
            pa.array([source] * n, pa.string()),
            pa.nulls(n, PACKED_SEQUENCE_SCHEMA.field("loss_mask").type),
        ],
        schema=PACKED_SEQUENCE_SCHEMA,
    )


def write_ember(directory: Path, table: pa.Table, seq_len: int, source: str) -> None:
    directory.mkdir(parents=True)
    schema = PACKED_SEQUENCE_SCHEMA.with_metadata({**PACKED_SEQUENCE_SCHEMA.metadata, ROWS_PER_BATCH_KEY: str(ROWS_PER_BATCH).encode()})
    entries = []
    for index, start in enumerate(range(0, table.num_rows, ROWS_PER_SHARD)):
        path = directory / f"shard-{index:06d}.arrow"
        part = table.slice(start, ROWS_PER_SHARD).replace_schema_metadata(schema.metadata)
        with ipc.new_file(path, schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
            writer.write_table(part, max_chunksize=ROWS_PER_BATCH)
        entries.append({"path": path.name, "rows": part.num_rows, "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    n = table.num_rows
    write_manifest(
        directory,
        Manifest(
            tokenizer={"name": "bench-random", "hash": "b" * 16, "vocab_size": VOCAB},
            seq_len=seq_len,
            dtype="uint16",
            sources={source: {"documents": 2 * n, "tokens": n * seq_len, "sequences": n, "padding_tokens": 0}},
            padding_tokens=0,
            pad_token_id=0,
            shards=entries,
            config_hash=f"bench-{source}-{n}",
            created_at="2026-12-02T00:00:00Z",
        ),
    )


def write_megatron(prefix: Path, table: pa.Table, seq_len: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, seq_len).astype(np.int64)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for row in tokens:
        builder.add_item(torch.from_numpy(row))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def ember_dataset(root: Path, n: int, seq_len: int) -> MidtrainDataset:
    return MidtrainDataset(
        [ShardSetSpec(root / "code", 0.7), ShardSetSpec(root / "web", 0.3)],
        num_samples=n, seed=1234, blend_period=1000, window_chunks=64, dense_attention_mask=True,
    )


def megatron_dataset(root: Path, n: int, seq_len: int, cache: Path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_len,
        blend=([str(root / "mcore-code"), str(root / "mcore-web")], [0.7, 0.3]),
        split="1,0,0",
        path_to_cache=str(cache),
        tokenizer=NullTokenizer(VOCAB),
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=False,
        create_attention_mask=True,
        add_extra_token_to_sequence=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, 0, 0], lambda: True, config).build()
    return train


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def read_collate(dataset, samples: int, order: np.ndarray | None = None) -> float:
    """Seconds to read `samples` samples: positions 0.. (the dataset's own order) or `order`'s first ones."""
    positions = range(samples) if order is None else order[:samples].tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, positions), batch_size=BATCH, num_workers=0)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=20_000, help="samples read per throughput run (capped at N)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ember-bench-midtrain-"))
    rows = []
    try:
        for n in args.sizes:
            root = work / f"n{n}"
            if root.exists():
                shutil.rmtree(root)
            root.mkdir(parents=True)
            n_code = int(n * 0.7)
            t_write = time.perf_counter()
            for source, count, seed in (("code", n_code, 1), ("web", n - n_code, 2)):
                table = synthetic_rows(count, args.seq_len, seed, source)
                write_ember(root / source, table, args.seq_len, source)
                write_megatron(root / f"mcore-{source}", table, args.seq_len)
            t_write = time.perf_counter() - t_write
            samples = min(args.samples, n)
            e_start, e_read, e_global, m_cold, m_warm, m_read = [], [], [], [], [], []
            global_order = np.random.default_rng(99).permutation(n)
            for _ in range(args.repeats):
                t, ds = timed(lambda: ember_dataset(root, n, args.seq_len))
                e_start.append(t)
                e_read.append(read_collate(ds, samples))
                e_global.append(read_collate(ember_dataset(root, n, args.seq_len), samples, global_order))
                cache = root / "mcore-cache"
                shutil.rmtree(cache, ignore_errors=True)
                t, ds = timed(lambda: megatron_dataset(root, n, args.seq_len, cache))
                m_cold.append(t)
                t, ds = timed(lambda: megatron_dataset(root, n, args.seq_len, cache))
                m_warm.append(t)
                m_read.append(read_collate(ds, samples))
            med = statistics.median
            e_sps, m_sps, g_sps = samples / med(e_read), samples / med(m_read), samples / med(e_global)
            rows.append(
                (n, t_write, med(e_start), med(m_cold), med(m_warm), e_sps, m_sps, e_sps * args.seq_len, m_sps * args.seq_len, g_sps)
            )
            print(f"N={n}: written in {t_write:.1f}s", flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nseq_len {args.seq_len}, batch {BATCH}, {args.repeats} repeats (medians), read+collate of min(N, {args.samples}) samples")
    header = (
        "| sequences | ember startup s | mcore startup cold s | mcore startup cached s | startup ratio mcore-cold/ember "
        "| ember samples/s (window-local order) | mcore samples/s (global shuffle) | ember tokens/s | mcore tokens/s "
        "| read ratio ember/mcore | ember samples/s (global shuffle) | read ratio, both global |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for n, _, es, mc, mw, e_sps, m_sps, e_tps, m_tps, g_sps in rows:
        print(
            f"| {n:,} | {es:.3f} | {mc:.3f} | {mw:.3f} | {mc / es:.1f}x | {e_sps:,.0f} | {m_sps:,.0f} "
            f"| {e_tps:,.0f} | {m_tps:,.0f} | {e_sps / m_sps:.2f}x | {g_sps:,.0f} | {g_sps / m_sps:.2f}x |"
        )


if __name__ == "__main__":
    main()
