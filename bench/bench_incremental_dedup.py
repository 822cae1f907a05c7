"""Incremental near dedup: release 2 deduplicated against release 1's MinHash index, against a full rebuild.

Two releases of planted prose: release 1 holds --docs documents (families of a base and word-edited variants);
release 2 holds --new documents, half of them variants of release-1 documents, half new families. Both sides run
ember's near-dedup stage on FnApiRunner in this process, the same settings (word 5-grams, 14 bands x 8 rows):

  anchor  full rebuild: `NearDedup` over release 1 + release 2 (every signature computed again)
  ember   incremental: `IncrementalNearDedup` over release 2 with `dedup.against: [release 1's index]`

Release 1's index is written once, before the timed runs (its cost is reported apart: the same near dedup with
`dedup.index` set). Reported: medians over --repeats of wall seconds, the speed-up (anchor / ember), and whether the
clusters restricted to release 2's documents are the same on both sides (they must be). Only the near-dedup stage is
timed: a real refresh also skips reading, filtering and exact-deduplicating release 1, which widens the gap.
Timing never decides pass/fail.

    .venv/bin/python bench/bench_incremental_dedup.py [--docs 2000] [--new 500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import apache_beam as beam

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.demo.sample_corpus import near_duplicate, prose  # noqa: E402
from ember.pipelines.corpus.config import CorpusSource, Dedup  # noqa: E402
from ember.pipelines.corpus.formats import record_to_row  # noqa: E402
from ember.pipelines.corpus.incremental import IncrementalNearDedup  # noqa: E402
from ember.pipelines.corpus.stages import NearDedup  # noqa: E402

SOURCE = CorpusSource.model_validate({"name": "web", "kind": "web", "inputs": ["x"], "fields": {"id": "id"}})


def rows(rng: random.Random, count: int, prefix: str, line: int, bases: list[str]) -> list[dict]:
    """`count` documents: families of 4 (a base and 3 variants); with `bases`, half are variants of those."""
    texts: list[str] = []
    while len(texts) < count:
        if bases and len(texts) < count // 2:
            texts.append(near_duplicate(rng, rng.choice(bases), 2))
            continue
        base = prose(rng, 12)
        texts += [base] + [near_duplicate(rng, base, 2) for _ in range(3)]
    found = []
    for i, text in enumerate(texts[:count]):
        row, rejected = record_to_row({"id": f"{prefix}{i}", "text": text}, SOURCE, f"{prefix}.jsonl:line={line + i}")
        assert rejected is None
        found.append(row)
    return found


def run(documents: list[dict], stage: beam.PTransform, out: Path) -> tuple[float, list[dict]]:
    """Wall seconds of the stage over `documents` (graph construction included), and its cluster rows."""
    started = time.perf_counter()
    with beam.Pipeline(runner="FnApiRunner") as p:
        _ = (p | beam.Create(documents) | stage).clusters | beam.combiners.ToList() | beam.Map(
            lambda items: out.write_bytes(pickle.dumps(items)))
    return time.perf_counter() - started, pickle.loads(out.read_bytes())


def clusters_of(clusters: list[dict], ids: set[str]) -> dict[str, str | None]:
    found = {c["document_id"]: c["cluster_id"] for c in clusters}
    return {i: found.get(i) for i in sorted(ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=None, help="documents in release 1 (quick 300, full 2000)")
    parser.add_argument("--new", type=int, default=None, help="documents in release 2 (quick 75, full 500)")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.docs = args.docs or profile_default(args.profile, 300, 2000)
    args.new = args.new or profile_default(args.profile, 75, 500)
    rng = random.Random(11)
    first = rows(rng, args.docs, "r1-", 1, [])
    second = rows(rng, args.new, "r2-", 1, [r["text"] for r in first])
    new = {r["id"] for r in second}
    with tempfile.TemporaryDirectory(prefix="bench-incremental-") as tmp:
        work = Path(tmp)
        index = str(work / "index")
        plain_s, _ = run(first, NearDedup(Dedup(), None), work / "plain.pkl")
        index_s, _ = run(first, IncrementalNearDedup(Dedup(index=index), None, 50_000), work / "index.pkl")
        full, incremental = [], []
        for _ in range(args.repeats):
            seconds, full_clusters = run(first + second, NearDedup(Dedup(), None), work / "full.pkl")
            full.append(seconds)
            seconds, new_clusters = run(second, IncrementalNearDedup(Dedup(against=[index]), None, 50_000), work / "new.pkl")
            incremental.append(seconds)
        same = clusters_of(new_clusters, new) == clusters_of(full_clusters, new)
    anchor, ember = statistics.median(full), statistics.median(incremental)
    print(f"release 1: {args.docs} documents, release 2: {args.new} documents, {args.repeats} repeats (medians)")
    print(f"release 1 near dedup: {plain_s:.1f} s plain, {index_s:.1f} s saving its index")
    print(f"anchor  full rebuild (release 1 + 2):          {anchor:6.1f} s")
    print(f"ember   release 2 against release 1's index:  {ember:6.1f} s")
    print(f"speed-up (anchor / ember): {anchor / ember:.2f}x; clusters of release 2's documents equal: {'yes' if same else 'NO'}")
    write_results(args.results, "bench_incremental_dedup", args.profile, [
        Figure("release 2 near dedup seconds", "s", ember, anchor, "full rebuild of release 1 + 2", higher_is_better=False,
               repeats=args.repeats)], docs=args.docs, new=args.new, clusters_equal=same)


if __name__ == "__main__":
    main()
