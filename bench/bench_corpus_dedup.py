"""Corpus build: near-dedup quality and end-to-end throughput, ember vs datatrove, same parameters.

Quality: a planted corpus of document families (a base plus variants: word edits at several rates,
reformatting, renamed identifiers, an appended license header) is deduplicated by ember's near-dedup
(MinHash, word 5-grams, 14 bands x 8 rows, distributed connected components) and by datatrove's
MinHash pipeline with the same parameters (stages 1-4, union-find clustering). Ground truth: exact
Jaccard of the word 5-gram sets, all pairs sharing any 5-gram (inverted index, so nothing is missed);
a pair is a true duplicate when its Jaccard >= the LSH threshold (1/14)^(1/8) ~ 0.72. Reported: pair
precision and recall of each tool's clusters.

Throughput, per core, on two corpora (each several zstd Parquet files; datatrove's JSONL reader needs orjson, absent):
  web   filter-passing pages (~1.2 KB) with ~10% planted near duplicates (2 words edited) and ~3% exact copies;
  code  real source files of this machine (this interpreter's stdlib and site-packages first, then the other
        installed interpreters and the uv cache), 200 B - 64 KB, with ~10% planted near duplicates (identifiers
        renamed, a licence header added, or 2% of lines edited).
Stages, the same on both sides where both have them: read -> (web) Gopher repetition + Gopher quality + C4 +
FineWeb filters (datatrove's classes, or ember's equal-verdict versions, same word splitter; ember's language
ID off, datatrove's side has none) / (code) ember's code heuristics (datatrove has none: ember does more work)
-> exact dedup -> MinHash near dedup (same n-grams, bands, rows, seed, 64-bit) -> write. ember runs on
FnApiRunner (in-process for one worker), datatrove on LocalPipelineExecutor. Each run is a fresh subprocess,
the tools interleaved; reported: medians of wall and CPU seconds (user + sys of the process tree: the per-core
figure that holds on a machine shared with other work), docs per CPU-second, and, from each tool's first run,
recall on the labelled pairs (planted pairs whose exact 5-gram Jaccard >= the threshold) and precision of the
pairs each tool's clusters predict. One seed's draw of the hash rows moves a tool's misses on code by more than
the gap between the tools, so with `--seeds K` (full profile 3) each tool also runs untimed with MinHash seeds
2..K and the recall compared is the mean over the K seeds, each seed's misses printed. Redaction is off for ember (datatrove has no equivalent stage).
datatrove hashes with sha1 (its default xxhash is not installed). Timing never decides pass/fail.

    .venv/bin/python bench/bench_corpus_dedup.py --profile quick|full [--results FILE]
    # quick: 300 families, 3000 web + 2000 code documents, 1 run each; full: 600, 100 000 + 100 000, 3 runs
    # --docs / --code-docs / --files / --repeats / --seeds / --only web|code / --skip-quality override a profile
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402

THRESHOLD = (1 / 14) ** (1 / 8)
N_GRAMS, BANDS, ROWS, SEED = 5, 14, 8, 1
MIT_HEADER = (
    "# Copyright (c) 2024 The Authors\n# Permission is hereby granted, free of charge, to any person obtaining a copy of "
    "this software and associated documentation files (the Software), to deal in the Software without restriction, "
    "including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell "
    "copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the "
    "following conditions: The above copyright notice and this permission notice shall be included in all copies or "
    "substantial portions of the Software.\n"
)


# ---------------------------------------------------------------- planted corpus


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "ly", "do", "fe", "gi", "ho"]
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def _zipf_text(rng: random.Random, vocab: list[str], weights: list[float], words: int) -> str:
    chosen = rng.choices(vocab, weights=weights, k=words)
    lines, line = [], []
    for w in chosen:
        line.append(w)
        if len(line) >= rng.randint(8, 14):
            lines.append(" ".join(line) + ".")
            line = []
    if line:
        lines.append(" ".join(line) + ".")
    return "\n".join(lines)


def _code(rng: random.Random, vocab: list[str], functions: int) -> tuple[str, list[str]]:
    names = [f"{rng.choice(vocab)}_{rng.choice(vocab)}" for _ in range(functions)]
    body = []
    for name in names:
        a, b = rng.sample(vocab, 2)
        body.append(
            f"def {name}({a}, {b}):\n    {rng.choice(vocab)} = {a} * {rng.randint(2, 99)} + {b}\n"
            f"    if {rng.choice(vocab)}({a}) > {rng.randint(1, 999)}:\n        return {rng.choice(vocab)}({b}, {a})\n"
            f"    return {rng.choice(names)}({b}, {rng.choice(vocab)})\n"
        )
    return "\n".join(body), names


def _edit(rng: random.Random, text: str, vocab: list[str], rate: float) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, int(rate * len(words)))):
        words[i] = rng.choice(vocab)
    return " ".join(words)


def _reformat(rng: random.Random, text: str) -> str:
    words = text.split()
    out, line = [], []
    for w in words:
        line.append(w.upper() if rng.random() < 0.1 else w)
        if len(line) >= rng.randint(5, 20):
            out.append("  ".join(line))
            line = []
    out.append(" ".join(line))
    return "\n\n".join(out)


def planted_corpus(families: int, seed: int = 3) -> list[dict]:
    """Families of one base document and its planted variants, ids 'f<family>-<variant>'."""
    rng = random.Random(seed)
    vocab = _vocabulary(rng, 20000)
    weights = [1 / (i + 1) ** 0.9 for i in range(len(vocab))]
    docs = []
    for f in range(families):
        if f % 2 == 0:
            base = _zipf_text(rng, vocab, weights, rng.randint(200, 500))
            variants = {
                "edit01": _edit(rng, base, vocab, 0.01), "edit05": _edit(rng, base, vocab, 0.05),
                "edit10": _edit(rng, base, vocab, 0.10), "edit20": _edit(rng, base, vocab, 0.20),
                "reformat": _reformat(rng, base),
            }
        else:
            base, names = _code(rng, vocab, rng.randint(6, 12))
            renamed = base
            for old in rng.sample(names, 2):
                renamed = renamed.replace(old, f"{old}_v2")
            variants = {"rename": renamed, "license": MIT_HEADER + base, "edit05": _edit(rng, base, vocab, 0.05)}
        docs.append({"id": f"f{f}-base", "text": base})
        chosen = rng.sample(sorted(variants), rng.randint(1, len(variants)))
        docs += [{"id": f"f{f}-{name}", "text": variants[name]} for name in sorted(chosen)]
    return docs


def _write_parquet(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(docs), path, compression="zstd")


def true_pairs(docs: list[dict]) -> tuple[set[tuple[str, str]], int]:
    """Pairs with exact 5-gram Jaccard >= THRESHOLD; also how many candidate pairs were checked."""
    from ember.pipelines.quality.minhash import jaccard, shingle_set

    sets = {d["id"]: shingle_set(d["text"], N_GRAMS) for d in docs}
    postings: dict[int, list[str]] = defaultdict(list)
    for doc_id, s in sets.items():
        for h in s:
            postings[h].append(doc_id)
    candidates: set[tuple[str, str]] = set()
    for ids in postings.values():
        if len(ids) > 1:
            candidates.update(tuple(sorted(p)) for p in combinations(ids, 2))
    return {p for p in candidates if jaccard(sets[p[0]], sets[p[1]]) >= THRESHOLD}, len(candidates)


def cluster_pairs(clusters: dict[str, str]) -> set[tuple[str, str]]:
    members: dict[str, list[str]] = defaultdict(list)
    for doc_id, cluster in clusters.items():
        members[cluster].append(doc_id)
    return {tuple(sorted(p)) for ids in members.values() for p in combinations(ids, 2)}


def precision_recall(predicted: set, truth: set) -> tuple[float, float]:
    hit = len(predicted & truth)
    return (hit / len(predicted) if predicted else 1.0), (hit / len(truth) if truth else 1.0)


def ember_clusters(docs: list[dict], work: Path) -> tuple[dict[str, str], float]:
    import polars as pl
    from apache_beam.options.pipeline_options import PipelineOptions

    from ember.pipelines.corpus.config import parse_config
    from ember.pipelines.corpus.pipeline import run
    from ember.pipelines.corpus.report import read_output

    _write_parquet(work / "in" / "planted.parquet", docs)
    off = {"enabled": False}
    config = parse_config({
        "sources": [{"name": "p", "kind": "web", "inputs": [str(work / "in" / "*.parquet")], "format": "parquet",
                     "fields": {"id": "id"}}],
        "filters": {"web": {k: off for k in ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality")}},
        "redaction": off, "dedup": {"exact": False, "n_grams": N_GRAMS, "bands": BANDS, "rows_per_band": ROWS, "seed": SEED},
        "output": {"directory": str(work / "out")},
    })
    start = time.perf_counter()
    run(config, PipelineOptions(["--runner=FnApiRunner"]))
    seconds = time.perf_counter() - start
    clusters = read_output(str(work / "out"), "clusters").filter(pl.col("stage") == "near_dedup")
    return {r["document_id"].split(":", 1)[1]: r["cluster_id"] for r in clusters.iter_rows(named=True)}, seconds


def _datatrove_minhash_config(seed: int = SEED):
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    return MinhashConfig(n_grams=N_GRAMS, num_buckets=BANDS, hashes_per_bucket=ROWS, seed=seed,
                         hash_config=HashConfig(precision=64, hash_fc="sha1"))


def datatrove_clusters(docs: list[dict], work: Path) -> tuple[dict[str, str], float]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter

    from ember.pipelines.quality.web_filters import RegexWordTokenizer

    _write_parquet(work / "in" / "planted.parquet", docs)
    cfg, tok, w = _datatrove_minhash_config(), RegexWordTokenizer(), str(work)
    start = time.perf_counter()
    for pipeline, tasks in (
        ([ParquetReader(f"{w}/in"), MinhashDedupSignature(f"{w}/sigs", config=cfg, language=tok)], 1),
        ([MinhashDedupBuckets(f"{w}/sigs", f"{w}/buckets", config=cfg)], BANDS),
        ([MinhashDedupCluster(f"{w}/buckets", f"{w}/remove", config=cfg, save_cluster_id=True)], 1),
        ([ParquetReader(f"{w}/in"),
          MinhashDedupFilter(f"{w}/remove", load_cluster_ids=True,
                             exclusion_writer=ParquetWriter(f"{w}/removed", expand_metadata=True)),
          ParquetWriter(f"{w}/kept", expand_metadata=True)], 1),
    ):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=f"{w}/logs/{len(os.listdir(w))}").run()
    seconds = time.perf_counter() - start
    clusters = {}
    for folder in ("kept", "removed"):
        for path in sorted((work / folder).glob("*.parquet")):
            for d in pq.read_table(path, columns=["id", "minhash_cluster_id"]).to_pylist():
                if d["minhash_cluster_id"] != -1:
                    clusters[d["id"]] = str(d["minhash_cluster_id"])
    return clusters, seconds


def quality(families: int, work: Path) -> None:
    docs = planted_corpus(families)
    truth, checked = true_pairs(docs)
    print(f"\n## Near-dedup quality: {len(docs)} documents in {families} planted families")
    print(f"ground truth: {len(truth)} pairs with exact 5-gram Jaccard >= {THRESHOLD:.3f} (of {checked} pairs sharing a 5-gram)\n")
    print("| tool | clustered docs | predicted pairs | precision | recall | seconds |")
    print("|---|---|---|---|---|---|")
    for name, fn in (("ember (Beam, star CC)", ember_clusters), ("datatrove MinHash", datatrove_clusters)):
        clusters, seconds = fn(docs, work / name.split()[0])
        predicted = cluster_pairs(clusters)
        p, r = precision_recall(predicted, truth)
        print(f"| {name} | {len(clusters)} | {len(predicted)} | {p:.4f} | {r:.4f} | {seconds:.1f} |")


# ---------------------------------------------------------------- throughput


def web_corpus(directory: Path, docs: int, files: int, seed: int = 11) -> tuple[int, list[tuple[str, str]]]:
    """Filter-passing web pages with ~10% planted near duplicates and ~3% exact ones; returns the bytes
    and the planted (original id, near-duplicate id) pairs."""
    from ember.demo.sample_corpus import near_duplicate, prose

    rng = random.Random(seed)
    directory.mkdir(parents=True)
    pages: list[str] = []
    planted: list[tuple[str, str]] = []
    for i in range(docs):
        roll = rng.random()
        if pages and roll < 0.03:
            pages.append(rng.choice(pages))
        elif pages and roll < 0.13:
            j = rng.randrange(len(pages))
            pages.append(near_duplicate(rng, pages[j], 2))
            planted.append((f"d{j}", f"d{i}"))
        else:
            pages.append(prose(rng, rng.randint(8, 20)))
    _write_parts(directory, pages, files)
    return sum(len(t.encode()) for t in pages), planted


def _write_parts(directory: Path, texts: list[str], files: int) -> None:
    for k in range(files):
        _write_parquet(directory / f"part-{k}.parquet", [{"id": f"d{i}", "text": t} for i, t in enumerate(texts) if i % files == k])


CODE_SUFFIXES = (".py", ".pyi", ".c", ".h", ".js", ".ts", ".cpp", ".hpp", ".rs", ".go", ".java", ".sh")


def _code_roots() -> list[Path]:
    """Where this machine keeps source files, most relevant first: this interpreter's stdlib and site-packages,
    then the other installed interpreters and the uv cache's unpacked wheels (only walked when more are needed)."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    roots += sorted(Path("/root/.pyenv/versions").glob("*/lib/python*")) + [Path.home() / ".cache/uv/archive-v0"]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def source_files(count: int, min_bytes: int = 200, max_bytes: int = 64_000) -> list[str]:
    """Up to `count` real source files' texts (UTF-8, min..max bytes), walked in sorted order, so a size is a prefix."""
    texts: list[str] = []
    seen: set[Path] = set()
    for root in _code_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if not name.endswith(CODE_SUFFIXES) or path.is_symlink():
                    continue
                real = path.resolve()
                if real in seen:
                    continue
                seen.add(real)
                try:
                    if not min_bytes <= path.stat().st_size <= max_bytes:
                        continue
                    texts.append(path.read_bytes().decode("utf-8"))
                except (OSError, UnicodeDecodeError):
                    continue
                if len(texts) == count:
                    return texts
    return texts


_IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{5,}\b")


def code_variant(rng: random.Random, text: str) -> str:
    """A planted near-duplicate of a source file: identifiers renamed, a licence header added, or a few lines edited."""
    kind = rng.choice(("rename", "license", "edit"))
    if kind == "rename":
        names = sorted(set(_IDENTIFIER.findall(text)))
        for old in rng.sample(names, min(2, len(names))):
            text = re.sub(rf"\b{old}\b", f"{old}_v2", text)
        return text
    if kind == "license":
        return MIT_HEADER + text
    lines = text.split("\n")
    for i in rng.sample(range(len(lines)), max(1, len(lines) // 50)):
        lines[i] = lines[i] + "  # patched"
    return "\n".join(lines)


def code_corpus(directory: Path, docs: int, files: int, seed: int = 13) -> tuple[int, list[tuple[str, str]]]:
    """Real source files from this machine with ~10% planted near-duplicates of earlier ones (a base is only
    chosen when its text occurs once and passes ember's code filters, so the planted pair reaches near dedup
    on both sides); returns the bytes and the planted pairs."""
    from ember.pipelines.quality.code_filters import check_code
    from ember.pipelines.quality.settings import CodeFilters

    rng = random.Random(seed)
    planted_count = docs // 10
    real = source_files(docs - planted_count)
    counts: dict[str, int] = defaultdict(int)
    for t in real:
        counts[t] += 1
    filters = CodeFilters()
    texts = list(real)
    planted: list[tuple[str, str]] = []
    eligible = [i for i, t in enumerate(real) if counts[t] == 1 and not check_code(t, {}, filters)[0]]
    for j in rng.sample(eligible, min(planted_count, len(eligible))):
        variant = code_variant(rng, real[j])
        if check_code(variant, {}, filters)[0]:
            continue
        texts.append(variant)
        planted.append((f"d{j}", f"d{len(texts) - 1}"))
    order = list(range(len(texts)))
    rng.shuffle(order)  # variants spread through the files, not all at the end
    position = {old: new for new, old in enumerate(order)}
    directory.mkdir(parents=True)
    _write_parts(directory, [texts[i] for i in order], files)
    pairs = [(f"d{position[int(a[1:])]}", f"d{position[int(b[1:])]}") for a, b in planted]
    return sum(len(t.encode()) for t in texts), pairs


def run_ember(kind: str, input_dir: str, out: str, workers: int, seed: int = SEED) -> int:
    from apache_beam.options.pipeline_options import PipelineOptions

    from ember.pipelines.corpus.config import parse_config
    from ember.pipelines.corpus.pipeline import run
    from ember.pipelines.corpus.report import read_stats
    from ember.pipelines.jobs.runners import local_args

    config = parse_config({
        "sources": [{"name": kind, "kind": kind, "inputs": [f"{input_dir}/*.parquet"], "format": "parquet"}],
        "filters": {"web": {"language_id": {"enabled": False}}},  # datatrove's side has no language ID
        "redaction": {"enabled": False},
        "dedup": {"n_grams": N_GRAMS, "bands": BANDS, "rows_per_band": ROWS, "seed": seed},
        "output": {"directory": out},
    })
    run(config, PipelineOptions(local_args(workers)))
    return read_stats(out)["totals"]["kept"]


def _text(doc) -> str:
    return doc.text


def run_datatrove(kind: str, input_dir: str, out: str, workers: int, files: int, seed: int = SEED) -> int:
    """datatrove's pipeline for the same build: web pages through the same four filter classes, code files
    unfiltered (datatrove has no code heuristics), then exact dedup and its four-stage MinHash dedup."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupFilter, ExactDedupSignature, ExactFindDedups
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter
    from datatrove.utils.hashing import HashConfig

    from ember.pipelines.quality.web_filters import RegexWordTokenizer

    tok, cfg = RegexWordTokenizer(), _datatrove_minhash_config(seed)
    exact = ExactDedupConfig(content_getter=_text, hash_config=HashConfig(precision=64, hash_fc="sha1"))
    filtered = input_dir
    stages = []
    if kind == "web":
        filtered = f"{out}/filtered"
        stages.append(([ParquetReader(input_dir), GopherRepetitionFilter(language=tok), GopherQualityFilter(language=tok),
                        C4QualityFilter(filter_no_terminal_punct=False, language=tok), FineWebQualityFilter(language=tok),
                        ParquetWriter(filtered, compression="zstd")], files))
    stages += [
        ([ParquetReader(filtered), ExactDedupSignature(f"{out}/exact_sigs", config=exact)], files),
        ([ExactFindDedups(f"{out}/exact_sigs", f"{out}/exact_dups", config=exact)], 1),
        ([ParquetReader(filtered), ExactDedupFilter(f"{out}/exact_dups", config=exact),
          ParquetWriter(f"{out}/exact", compression="zstd")], files),
        ([ParquetReader(f"{out}/exact"), MinhashDedupSignature(f"{out}/sigs", config=cfg, language=tok)], files),
        ([MinhashDedupBuckets(f"{out}/sigs", f"{out}/buckets", config=cfg)], BANDS),
        ([MinhashDedupCluster(f"{out}/buckets", f"{out}/remove", config=cfg, save_cluster_id=True)], 1),
        ([ParquetReader(f"{out}/exact"),
          MinhashDedupFilter(f"{out}/remove", load_cluster_ids=True,
                             exclusion_writer=ParquetWriter(f"{out}/removed", compression="zstd", expand_metadata=True)),
          ParquetWriter(f"{out}/final", compression="zstd", expand_metadata=True)], files),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=f"{out}/logs/{i}").run()
    return sum(pq.read_metadata(p).num_rows for p in Path(f"{out}/final").glob("*.parquet"))


def run_clusters(tool: str, input_dir: Path, out: Path) -> dict[str, str]:
    """Input id -> near-dedup cluster of a finished throughput run (documents in no cluster are absent)."""
    if tool == "datatrove":
        clusters = {}
        for folder in ("final", "removed"):
            for path in sorted((out / folder).glob("*.parquet")):
                for d in pq.read_table(path, columns=["id", "minhash_cluster_id"]).to_pylist():
                    if d["minhash_cluster_id"] != -1:
                        clusters[d["id"]] = str(d["minhash_cluster_id"])
        return clusters
    import polars as pl

    from ember.pipelines.corpus.report import read_output

    ids = {str(path): pq.read_table(path, columns=["id"]).column("id").to_pylist() for path in sorted(input_dir.glob("*.parquet"))}
    rows = read_output(str(out), "clusters").filter(pl.col("stage") == "near_dedup").select("location", "cluster_id")
    clusters = {}
    for location, cluster in rows.iter_rows():
        path, row = location.rsplit(":row=", 1)
        clusters[ids[path][int(row) - 1]] = cluster
    return clusters


def corpus_labels(kind: str, directory: Path, docs: int, files: int) -> dict:
    """Writes the corpus and returns what scoring needs, so no process holds its texts while the tools run:
    the bytes, the labelled pairs (planted pairs whose exact 5-gram Jaccard >= THRESHOLD, decided here while
    the texts are at hand), and each id's text digest (exact dedup keeps one of identical texts: any stands for it)."""
    import hashlib

    from ember.pipelines.quality.minhash import jaccard, shingle_set

    total_bytes, planted = (web_corpus if kind == "web" else code_corpus)(directory, docs, files)
    digests, texts = {}, {}
    wanted = {doc_id for pair in planted for doc_id in pair}
    for path in sorted(directory.glob("*.parquet")):
        for d in pq.read_table(path).to_pylist():
            digests[d["id"]] = hashlib.blake2b(d["text"].encode(), digest_size=12).hexdigest()
            if d["id"] in wanted:
                texts[d["id"]] = d["text"]
    scored = [(a, b, jaccard(shingle_set(texts[a], N_GRAMS), shingle_set(texts[b], N_GRAMS))) for a, b in planted]
    labelled = [(a, b, j) for a, b, j in scored if j >= THRESHOLD]
    return {"bytes": total_bytes, "planted": len(planted), "labelled": [(a, b) for a, b, _ in labelled],
            "expected_misses": expected_misses([j for _, _, j in labelled]), "digests": digests}


def expected_misses(jaccards: list[float]) -> tuple[float, float]:
    """Mean and standard deviation of the labelled pairs a MinHash LSH with ideal random hashes misses: a pair of
    Jaccard J shares no band with probability (1 - J^ROWS)^BANDS. Either tool's misses within ~2 sd of the mean
    are its hash family's luck, not a recall loss."""
    p = [(1 - j**ROWS) ** BANDS for j in jaccards]
    return sum(p), sum(x * (1 - x) for x in p) ** 0.5


def cluster_texts(input_dir: Path, ids: set[str]) -> dict[str, bytes]:
    """The texts of `ids` only, zlib-compressed (code and prose shrink ~4x), read from the input files one at a time."""
    import zlib

    texts = {}
    for path in sorted(input_dir.glob("*.parquet")):
        table = pq.read_table(path)
        for doc_id, text in zip(table.column("id").to_pylist(), table.column("text").to_pylist()):
            if doc_id in ids:
                texts[doc_id] = zlib.compress(text.encode(), 1)
    return texts


def recall_precision(clusters: dict[str, str], labelled: list[tuple[str, str]], digests: dict[str, str],
                     input_dir: Path, max_members: int = 40) -> tuple[float, float, int]:
    """Recall on the labelled planted pairs (found when a copy of each is in one cluster: exact dedup runs first
    and may keep either copy), from ids and digests alone; precision of the predicted pairs (all pairs within each
    cluster, its first `max_members` ids in sorted order) by exact 5-gram Jaccard >= the LSH threshold, from the
    texts of those members only, shingled one cluster at a time."""
    import zlib

    from ember.pipelines.quality.minhash import jaccard, shingle_set

    copies: dict[str, list[str]] = defaultdict(list)
    for doc_id, digest in digests.items():
        copies[digest].append(doc_id)

    def cluster_of(doc_id: str) -> set[str]:
        return {clusters[c] for c in copies[digests[doc_id]] if c in clusters}

    found = sum(1 for a, b in labelled if cluster_of(a) & cluster_of(b))
    members: dict[str, list[str]] = defaultdict(list)
    for doc_id, cluster in clusters.items():
        members[cluster].append(doc_id)
    scored = [sorted(ids)[:max_members] for ids in members.values()]
    texts = cluster_texts(input_dir, {doc_id for ids in scored for doc_id in ids})
    predicted = true = 0
    for ids in scored:
        sets = {doc_id: shingle_set(zlib.decompress(texts[doc_id]).decode(), N_GRAMS) for doc_id in ids}
        for a, b in combinations(ids, 2):
            predicted += 1
            true += jaccard(sets[a], sets[b]) >= THRESHOLD
    return (found / len(labelled) if labelled else 1.0), (true / predicted if predicted else 1.0), predicted


def _child(args: argparse.Namespace) -> None:
    """One timed run in this fresh process; prints a JSON line for the parent."""
    me = psutil.Process()
    peak = {"sum": 0, "max": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):  # sparse: listing children scans /proc, CPU counted against both tools
            try:
                rss = [me.memory_info().rss] + [c.memory_info().rss for c in me.children(recursive=True)]
            except psutil.Error:
                continue
            peak["sum"], peak["max"] = max(peak["sum"], sum(rss)), max(peak["max"], max(rss))

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if args.tool == "ember":
        kept = run_ember(args.kind, args.input, args.out, args.workers, args.seed)
    else:
        kept = run_datatrove(args.kind, args.input, args.out, args.workers, args.files, args.seed)
    seconds = time.perf_counter() - start
    stop.set()
    print(json.dumps({"seconds": seconds, "kept": kept, "rss_sum_mb": peak["sum"] / 2**20, "rss_max_mb": peak["max"] / 2**20}))


def run_tool(kind: str, tool: str, input_dir: Path, out: Path, workers: int, files: int, seed: int = SEED) -> dict:
    """One fresh-process run of `tool`: its child's JSON line plus the CPU seconds of its process tree."""
    cmd = [sys.executable, __file__, "_child", kind, tool, str(input_dir), str(out), str(workers), str(files), "--seed", str(seed)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.run(cmd, capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"{tool} run (seed {seed}) failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "cpu": cpu}


def score(tool: str, input_dir: Path, out: Path, labels_file: Path) -> list:
    """(recall, precision, predicted pairs) of a finished run, scored in a fresh process: reading the clustered
    texts leaves this one's heap as it was."""
    cmd = [sys.executable, __file__, "_score", tool, str(input_dir), str(out), str(labels_file)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def seed_recalls(kind: str, input_dir: Path, labels_file: Path, seeds: int, workers: int, files: int, work: Path,
                 first: dict[str, float], labelled: int, ideal: tuple[float, float]) -> dict[str, float]:
    """Recall of each tool over MinHash seeds 1..`seeds` (seed 1 is the timed run's, `first`): one seed's draw of
    the hash rows moves a tool's misses by more than the gap between the tools (BENCHMARKS' hash family study), so
    the recall the tools are compared on is the mean over seeds. Untimed runs, the tools interleaved."""
    found: dict[str, list[float]] = {tool: [recall] for tool, recall in first.items()}
    for seed in range(2, seeds + 1):
        for tool in found:
            out = work / f"{kind}-{tool}-seed{seed}"
            run_tool(kind, tool, input_dir, out, workers, files, seed)
            found[tool].append(score(tool, input_dir, out, labels_file)[0])
            shutil.rmtree(out, ignore_errors=True)
    print(f"\nRecall over MinHash seeds 1..{seeds} ({labelled} labelled pairs; ideal random hashes miss "
          f"{ideal[0]:.1f} +- {ideal[1]:.1f} per seed):\n")
    print("| tool | mean recall | se | misses per seed: mean (min-max) | per seed |")
    print("|---|---|---|---|---|")
    means = {}
    for tool, recalls in found.items():
        misses = [round((1 - r) * labelled) for r in recalls]
        means[tool] = statistics.fmean(recalls)
        se = statistics.stdev(recalls) / len(recalls) ** 0.5
        print(f"| {tool} | {means[tool]:.4f} | {se:.4f} | {statistics.fmean(misses):.1f} ({min(misses)}-{max(misses)}) | "
              f"{', '.join(map(str, misses))} |")
    return means


def throughput(kind: str, docs: int, files: int, repeats: int, workers: int, work: Path, seeds: int = 1) -> list:
    """Interleaved fresh-process runs of both tools on one corpus; prints the table and returns its Figures.
    With `seeds` > 1 the recall compared is the mean over that many MinHash seeds (`seed_recalls`)."""
    input_dir = work / kind
    labels_file = work / f"{kind}-labels.json"
    # a fresh process writes the corpus: the texts it held are gone before the tools run
    subprocess.run([sys.executable, __file__, "_corpus", kind, str(input_dir), str(labels_file), str(docs), str(files)],
                   check=True)
    labels = json.loads(labels_file.read_text())
    total_bytes, labelled, miss_mean, miss_sd = labels["bytes"], labels["labelled"], *labels["expected_misses"]
    docs = len(labels.pop("digests"))
    print(f"\n## {kind}: {docs} documents ({total_bytes / 1e6:.1f} MB) in {files} files, {workers} worker(s), "
          f"median of {repeats} interleaved runs; {len(labelled)} labelled near-duplicate pairs "
          f"(of {labels['planted']} planted, exact 5-gram Jaccard >= {THRESHOLD:.3f}; ideal random hashes would miss "
          f"{miss_mean:.1f} +- {miss_sd:.1f} of them); load average {os.getloadavg()[0]:.1f}\n")
    print("| tool | wall s | CPU s | docs per CPU-s | MB per CPU-s | kept | recall | precision (pairs) | peak RSS sum MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    runs: dict[str, list[dict]] = {"ember": [], "datatrove": []}
    for r in range(repeats):
        for tool in ("ember", "datatrove"):
            out = work / f"{kind}-{tool}-{r}"
            result = run_tool(kind, tool, input_dir, out, workers, files)
            if r == 0:
                result["quality"] = score(tool, input_dir, out, labels_file)
            runs[tool].append(result)
            shutil.rmtree(out, ignore_errors=True)
    med = {}
    for tool, rs in runs.items():
        m = {k: statistics.median(x[k] for x in rs) for k in ("seconds", "cpu", "rss_sum_mb")}
        recall, precision, pairs = rs[0]["quality"]
        med[tool] = m
        print(f"| {tool} | {m['seconds']:.2f} | {m['cpu']:.2f} | {docs / m['cpu']:,.0f} | {total_bytes / 1e6 / m['cpu']:.3f} | "
              f"{rs[0]['kept']} | {recall:.4f} | {precision:.4f} ({pairs}) | {m['rss_sum_mb']:.0f} |")
        m["recall"] = recall
    if seeds > 1:
        means = seed_recalls(kind, input_dir, labels_file, seeds, workers, files, work,
                             {tool: m["recall"] for tool, m in med.items()}, len(labelled), (miss_mean, miss_sd))
        for tool, recall in means.items():
            med[tool]["recall"] = recall
    e, d = med["ember"], med["datatrove"]
    recall_over = f"mean over seeds 1..{seeds}" if seeds > 1 else "seed 1"
    print(f"\nember / datatrove: **{d['cpu'] / e['cpu']:.2f}x** docs per CPU-second, {d['seconds'] / e['seconds']:.2f}x wall "
          f"(target 1.2x per core); recall ({recall_over}) {e['recall']:.4f} vs {d['recall']:.4f}; the bench's own peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return [
        Figure(f"{kind} filter + dedup, docs per CPU-s ({docs} docs)", "docs/CPU-s", docs / e["cpu"], docs / d["cpu"],
               "datatrove", repeats=repeats, target=1.2),
        Figure(f"{kind} near-dedup recall on planted pairs ({recall_over})", "recall", e["recall"], d["recall"], "datatrove"),
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_corpus":
        kind, directory, labels_file, docs, files = sys.argv[2:7]
        Path(labels_file).write_text(json.dumps(corpus_labels(kind, Path(directory), int(docs), int(files))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_score":
        tool, input_dir, out, labels_file = sys.argv[2:6]
        labels = json.loads(Path(labels_file).read_text())
        clusters = run_clusters(tool, Path(input_dir), Path(out))
        print(json.dumps(recall_precision(clusters, [tuple(p) for p in labels["labelled"]], labels["digests"], Path(input_dir))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        p = argparse.ArgumentParser()
        for name in ("mode", "kind", "tool", "input", "out"):
            p.add_argument(name)
        p.add_argument("workers", type=int)
        p.add_argument("files", type=int)
        p.add_argument("--seed", type=int, default=SEED)
        _child(p.parse_args())
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(p)
    p.add_argument("--families", type=int, default=None, help="planted families for the quality run (quick 300, full 600)")
    p.add_argument("--docs", type=int, default=None, help="web documents (quick 3000, full 100000)")
    p.add_argument("--code-docs", type=int, default=None, help="code files (quick 2000, full 100000)")
    p.add_argument("--files", type=int, default=None, help="input Parquet files per corpus (quick 4, full 16)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per tool (quick 1, full 3)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--only", choices=("web", "code"), default=None, help="one corpus of the throughput runs")
    p.add_argument("--seeds", type=int, default=None,
                   help="MinHash seeds whose mean recall the tools are compared on (quick 1, full 3; seed 1 is the timed run's)")
    args = p.parse_args()
    families = args.families or profile_default(args.profile, 300, 600)
    sizes = {"web": args.docs or profile_default(args.profile, 3000, 100_000),
             "code": args.code_docs or profile_default(args.profile, 2000, 100_000)}
    files = args.files or profile_default(args.profile, 4, 16)
    repeats = args.repeats or profile_default(args.profile, 1, 3)
    seeds = args.seeds or profile_default(args.profile, 1, 3)
    work = Path(tempfile.mkdtemp(prefix="ember-bench-corpus-"))
    figures = []
    try:
        print(f"# bench_corpus_dedup — {os.cpu_count()} cores, ember vs datatrove "
              f"(word {N_GRAMS}-grams, {BANDS} bands x {ROWS} rows, threshold {THRESHOLD:.3f})")
        if not args.skip_quality:
            quality(families, work / "quality")
        for kind in ("web", "code"):
            if args.only in (None, kind):
                figures += throughput(kind, sizes[kind], files, repeats, args.workers, work / "throughput", seeds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args.results, "corpus_dedup", args.profile, figures, sizes=sizes, files=files, workers=args.workers,
                  minhash={"n_grams": N_GRAMS, "bands": BANDS, "rows": ROWS}, seeds=seeds)


if __name__ == "__main__":
    main()
