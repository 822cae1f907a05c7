"""Mid-training loader: ember's Arrow shard dataset vs megatron-core GPTDataset on the same tokens.

For each size N (default 10^3, 10^5, 10^6 sequences of --seq-len tokens) it writes two shard sets
(70% / 30% of N, zstd Arrow IPC, PACKED_SEQUENCE_SCHEMA, two documents per row) and the same rows
as Megatron `.bin/.idx` with megatron-core's own `IndexedDatasetBuilder` (one sequence = one
document, so a Megatron sample of seq_len tokens is one stored row). Then, in one run:

- startup: constructing the blended dataset. ember reads manifests and shard footers; Megatron
  builds (cold: empty cache dir) or loads (cached) its document/sample/shuffle/blend indices with
  `BlendedMegatronDatasetBuilder(GPTDataset, ...)`, blend weights 0.7/0.3, one epoch of samples.
- read+collate: the first --samples samples of each dataset's own blended order through a
  `DataLoader(batch_size=8, num_workers=0)`, with block-diagonal attention masks and reset
  position ids on both sides (ember from cu_seqlens, Megatron from EOD tokens). ember is read as
  training reads it (`GlobalOrderSampler`, read-ahead on) in two shuffle scopes:
  window-local (rows shuffled within windows of 64 record batches of 128 rows) and a global
  shuffle (one window over every record batch, a uniform permutation of each set's rows, as
  megatron-core's), plus the global shuffle without read-ahead (the LRU of record batches alone,
  the loader before read-ahead). Memory: ember's own peak of decoded bytes held (record batches
  + read-ahead rows, bounded by --cache-mib) and the process's peak RSS growth during the read.

Both sides run with one torch thread, as in a DataLoader worker process. Medians over --repeats, interleaved. Files are in the page cache for all (just written). Timing is
reported, never asserted.

    .venv/bin/python bench/bench_midtrain_loader.py --profile quick|full [--results FILE]
    .venv/bin/python bench/bench_midtrain_loader.py [--sizes 1000 100000 1000000] [--samples 20000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.midtrain.data import GlobalOrderSampler, MidtrainDataset, ShardSetSpec  # noqa: E402
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, write_manifest  # noqa: E402
from ember.tokenize.shards import ROWS_PER_BATCH_KEY  # noqa: E402
from ember.tokenize.shardset import file_sha256  # noqa: E402

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


WINDOW_CHUNKS = 64
GLOBAL = 2**31  # one shuffle window over every record batch: a uniform permutation of each set's rows


def ember_dataset(root: Path, n: int, window_chunks: int, cache_mib: int) -> MidtrainDataset:
    return MidtrainDataset(
        [ShardSetSpec(root / "code", 0.7), ShardSetSpec(root / "web", 0.3)],
        num_samples=n, seed=1234, blend_period=1000, window_chunks=window_chunks, dense_attention_mask=True,
        cache_bytes=cache_mib * 2**20,
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


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_peak_growth(fn) -> tuple[object, int]:
    """fn()'s result and how far the process's resident set rose above its start during it (bytes):
    the kernel's peak (VmHWM) is reset first; 0 where /proc does not allow that."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return fn(), 0
    before = _status_kib("VmRSS")
    out = fn()
    return out, max(0, _status_kib("VmHWM") - before) * 1024


def read_ember(dataset: MidtrainDataset, samples: int, read_ahead: bool) -> tuple[float, int, int]:
    """(seconds, peak decoded bytes held, peak RSS growth) to read the first `samples` positions as training does."""
    sampler = GlobalOrderSampler(0, samples, BATCH, 1, 0)
    if read_ahead:
        dataset.read_ahead(sampler)

    def run() -> float:
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        return time.perf_counter() - t0

    seconds, rss = rss_peak_growth(run)
    return seconds, dataset.stats.peak_bytes, rss


def read_megatron(dataset, samples: int) -> float:
    """Seconds to read positions 0..samples-1 of megatron-core's dataset (its own global shuffle)."""
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(samples)), batch_size=BATCH, num_workers=0)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def write_inputs(root: Path, n: int, seq_len: int) -> float:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    n_code = int(n * 0.7)
    t_write = time.perf_counter()
    for source, count, seed in (("code", n_code, 1), ("web", n - n_code, 2)):
        table = synthetic_rows(count, seq_len, seed, source)
        write_ember(root / source, table, seq_len, source)
        write_megatron(root / f"mcore-{source}", table, seq_len)
    return time.perf_counter() - t_write


def measure(root: Path, n: int, args) -> dict:
    """Medians over interleaved repeats of every reading at size n."""
    samples = min(args.samples, n)
    runs: dict[str, list] = {k: [] for k in ("e_start", "m_cold", "m_warm", "window", "global", "global_lru", "mcore")}
    for _ in range(args.repeats):
        t, ds = timed(lambda: ember_dataset(root, n, WINDOW_CHUNKS, args.cache_mib))
        runs["e_start"].append(t)
        runs["window"].append(read_ember(ds, samples, read_ahead=True))
        runs["global"].append(read_ember(ember_dataset(root, n, GLOBAL, args.cache_mib), samples, read_ahead=True))
        runs["global_lru"].append(read_ember(ember_dataset(root, n, GLOBAL, args.cache_mib), samples, read_ahead=False))
        cache = root / "mcore-cache"
        shutil.rmtree(cache, ignore_errors=True)
        t, ds = timed(lambda: megatron_dataset(root, n, args.seq_len, cache))
        runs["m_cold"].append(t)
        t, ds = timed(lambda: megatron_dataset(root, n, args.seq_len, cache))
        runs["m_warm"].append(t)
        runs["mcore"].append(read_megatron(ds, samples))
    med = statistics.median
    out = {"n": n, "samples": samples, "e_start": med(runs["e_start"]), "m_cold": med(runs["m_cold"]),
           "m_warm": med(runs["m_warm"]), "mcore_sps": samples / med(runs["mcore"]),
           "load": os.getloadavg()}  # the machine's 1/5/15-minute load as this size's repeats end
    for key in ("window", "global", "global_lru"):
        out[f"{key}_sps"] = samples / med(r[0] for r in runs[key])
        out[f"{key}_cache"] = max(r[1] for r in runs[key])
        out[f"{key}_rss"] = max(r[2] for r in runs[key])
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="default: quick 100000; full 1000 100000 1000000")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=None, help="samples read per run, capped at N (quick 4000, full 20000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-mib", type=int, default=512, help="ember's data.cache_mib (default as in the config)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    args = parser.parse_args()
    torch.set_num_threads(1)  # what a DataLoader worker runs with; a thread pool per read only fights the other cores' jobs
    args.sizes = args.sizes or profile_default(args.profile, [100_000], [1000, 100_000, 1_000_000])
    args.samples = args.samples or profile_default(args.profile, 4000, 20_000)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ember-bench-midtrain-"))
    rows = []
    try:
        for n in args.sizes:
            t_write = write_inputs(work / f"n{n}", n, args.seq_len)
            print(f"N={n}: written in {t_write:.1f}s", flush=True)
            rows.append(measure(work / f"n{n}", n, args))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nseq_len {args.seq_len}, batch {BATCH}, {args.repeats} interleaved repeats (medians), read+collate of "
          f"min(N, {args.samples}) samples, cache {args.cache_mib} MiB, load average {load} (1/5/15 min) at the end")
    header = ("| sequences | ember startup s | mcore startup cold s | mcore startup cached s | startup ratio mcore-cold/ember "
              "| ember samples/s window-local | ember samples/s global shuffle | global / window-local "
              "| ember global, no read-ahead | mcore samples/s global shuffle | ember global / mcore | load 1/5/15 min |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        print(f"| {r['n']:,} | {r['e_start']:.3f} | {r['m_cold']:.3f} | {r['m_warm']:.3f} | {r['m_cold'] / r['e_start']:.1f}x "
              f"| {r['window_sps']:,.0f} | {r['global_sps']:,.0f} | {r['global_sps'] / r['window_sps']:.2f}x "
              f"| {r['global_lru_sps']:,.0f} | {r['mcore_sps']:,.0f} | {r['global_sps'] / r['mcore_sps']:.2f}x "
              f"| {' / '.join(f'{x:.1f}' for x in r['load'])} |")
    print("\nmemory (MiB): ember's peak decoded bytes held / the process's peak RSS growth during the read")
    print("| sequences | window-local | global shuffle | global, no read-ahead |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']:,} | " + " | ".join(f"{mib(r[k + '_cache'])} / {mib(r[k + '_rss'])}" for k in ("window", "global", "global_lru")) + " |")
    top = rows[-1]
    figures = [
        Figure("global-shuffle read rate vs window-local (same dataset, same run)", "samples/s", top["global_sps"],
               top["window_sps"], "ember window-local order", repeats=args.repeats, target=0.5),
        Figure("global-shuffle read rate", "samples/s", top["global_sps"], top["mcore_sps"],
               "megatron-core GPTDataset (global shuffle)", repeats=args.repeats),
        Figure("startup", "s", top["e_start"], top["m_cold"], "megatron-core index build (cold)",
               higher_is_better=False, repeats=args.repeats),
    ]
    write_results(args.results, "midtrain_loader", args.profile, figures, sizes=args.sizes, samples=args.samples,
                  seq_len=args.seq_len, cache_mib=args.cache_mib, rows=rows)


if __name__ == "__main__":
    main()
