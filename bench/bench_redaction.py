"""Redaction quality and throughput: ember's redactor vs datatrove's PIIFormatter on the labelled set.

Labelled set (tests/pipelines/redaction_labelled.py): planted secrets with their spans in realistic
Python, JS, YAML, shell, .env, SQL, JSON and prose files, and a clean set of hand-written negatives
plus the first --stdlib-files modules of this interpreter's standard library.

Recall: share of planted secrets of which nothing survives in the output. False positives: redactions
on the clean files, per file and per 1,000 lines; emails there are real authors' addresses (both tools
redact them on purpose), so they are reported apart and not counted as false positives. datatrove's
PIIFormatter only knows emails and IPv4 addresses: its recall is bounded by that, it is the anchor for
those two types and for speed. Throughput: MB of input text (planted + clean) per CPU-second, median
of --repeats.

--adversarial: CPU seconds of one `redact` on each input of tests/pipelines/redaction_adversarial.py at
64 KB, 256 KB and 1 MB (median of --repeats; one over --cap wall seconds is stopped and shown as `>cap`),
and the 1 MB / 64 KB ratio: ~16 is linear, ~256 quadratic; the same for datatrove's PIIFormatter, the anchor.

    .venv/bin/python bench/bench_redaction.py [--stdlib-files 150] [--repeats 5] [--also old_redaction.py]
    .venv/bin/python bench/bench_redaction.py --adversarial [--repeats 3] [--cap 20] [--also old_redaction.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ember and its tests' labelled set

from datatrove.pipeline.formatters import PIIFormatter  # noqa: E402

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.pipelines.quality.settings import Redaction  # noqa: E402
from ember.pipelines.quality.redaction import redact  # noqa: E402
from tests.pipelines.redaction_adversarial import INPUTS  # noqa: E402
from tests.pipelines.redaction_labelled import Labelled, Score, clean, planted, score  # noqa: E402

SIZES = {"64 KB": 2**16, "256 KB": 2**18, "1 MB": 2**20}


def ember_tool(redact_fn: Callable = redact) -> tuple[Callable[[str], str], Callable[[str], Counter[str]]]:
    config = Redaction()
    return (lambda text: redact_fn(text, config)[0]), (lambda text: Counter(redact_fn(text, config)[1]))


def module_redact(path: str) -> Callable:
    """`redact` of another version of ember/pipelines/quality/redaction.py (e.g. `git show main:...` saved to a file)."""
    spec = importlib.util.spec_from_file_location("redaction_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.redact


def datatrove_tool() -> tuple[Callable[[str], str], Callable[[str], Counter[str]]]:
    formatter = PIIFormatter()

    def hits(text: str) -> Counter[str]:
        """What `format` replaces, counted the way it replaces it: emails first, then validated IPv4s."""
        emails = sum(1 for _ in formatter.emails_replacer.regex.finditer(text))
        rest = formatter.emails_replacer.replace(text)
        ips = sum(1 for m in formatter.ip_replacer.regex.finditer(rest) if formatter.ip_replacer.validator(m.group(0)))
        return Counter({k: n for k, n in (("email", emails), ("ip_address", ips)) if n})

    return formatter.format, hits


def throughput(tools: dict[str, Callable[[str], str]], docs: list[Labelled], repeats: int) -> dict[str, float]:
    """Median MB of input text per CPU-second of this process over `repeats` passes of each tool, the tools
    taking turns (CPU time, not wall time: the figure holds on a machine shared with other work)."""
    size = sum(len(d.text.encode("utf-8")) for d in docs)
    rates: dict[str, list[float]] = {name: [] for name in tools}
    for _ in range(repeats):
        for name, redact_text in tools.items():
            start = time.process_time()
            for doc in docs:
                redact_text(doc.text)
            rates[name].append(size / (time.process_time() - start) / 1e6)
    return {name: statistics.median(r) for name, r in rates.items()}


def report(name: str, result: Score, mb_s: float) -> None:
    fp = result.false_positives
    not_email = frozenset({"email"})
    print(f"\n## {name}")
    print(f"recall {result.recall:.3f} ({result.removed}/{result.planted} planted secrets fully removed)")
    for kind in sorted(result.by_type):
        print(f"  {kind:<15} {result.removed_by_type[kind]}/{result.by_type[kind]}")
    print(f"false positives on {result.clean_files} clean files, {result.clean_lines} lines (emails apart): "
          f"{result.fp_per_file(not_email):.3f}/file, {result.fp_per_kline(not_email):.3f}/1k lines, by type {dict(fp - Counter({'email': fp['email']}))}")
    print(f"author emails redacted in the clean set: {fp['email']}")
    print(f"precision (removed / removed + clean-set redactions, emails apart) {result.precision(exclude=not_email):.3f}, "
          f"ip_address {result.precision('ip_address'):.3f}")
    print(f"throughput {mb_s:.2f} MB per CPU-second (median)")
    if result.missed:
        print("missed:", ", ".join(f"{f}:{t}" for f, t, _ in result.missed))


def _median_seconds(redact_fn: Callable, text: str, repeats: int) -> float:
    config, runs = Redaction(time_limit_s=None), []
    for _ in range(repeats):
        start = time.process_time()
        redact_fn(text, config)
        runs.append(time.process_time() - start)
    return statistics.median(runs)


def capped_seconds(redact_fn: Callable, text: str, repeats: int, cap: float) -> float | None:
    """Median CPU seconds of `redact_fn(text)` in a forked child, or None when the child is still at it
    after `cap` wall seconds (then it is killed: a regex cannot be stopped from outside its thread)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send(_median_seconds(redact_fn, text, repeats)))
    child.start()
    try:
        return receive.recv() if receive.poll(cap) else None
    finally:
        child.kill()
        child.join()


def adversarial(name: str, redact_fn: Callable, repeats: int, cap: float) -> None:
    """One row per adversarial input; after a size passes `cap`, the larger sizes are not tried."""
    print(f"\n## {name}: CPU seconds per document (median of {repeats}), cap {cap:g} s\n")
    print(f"| input | {' | '.join(SIZES)} | 1 MB / 64 KB |\n|---|{'---|' * len(SIZES)}---|")
    for label, build in INPUTS.items():
        cells, seconds = [], {}
        for size_name, size in SIZES.items():
            took = capped_seconds(redact_fn, build(size), repeats, cap) if len(seconds) == len(cells) else None
            cells.append(f"{took:.3f}" if took is not None else f">{cap:g}")
            if took is not None:
                seconds[size_name] = took
        ratio = seconds["1 MB"] / max(seconds["64 KB"], 1e-6) if len(seconds) == len(SIZES) else None
        print(f"| {label} | {' | '.join(cells)} | {f'{ratio:.0f}x' if ratio is not None else '-'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib-files", type=int, default=None, help="default: quick 40, full 150")
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 3, full 5")
    parser.add_argument("--also", metavar="REDACTION_PY", help="also score this version of redaction.py (e.g. main's)")
    parser.add_argument("--adversarial", action="store_true", help="time each adversarial input instead")
    parser.add_argument("--cap", type=float, default=20.0, help="--adversarial: wall seconds after which a run is stopped")
    add_flags(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or profile_default(args.profile, 3, 5)
    args.stdlib_files = args.stdlib_files or profile_default(args.profile, 40, 150)
    if args.adversarial:
        adversarial("ember redaction", redact, args.repeats, args.cap)
        anchor = datatrove_tool()[0]
        adversarial("datatrove PIIFormatter (the anchor: emails and IPv4 only)", lambda text, _config: anchor(text),
                    args.repeats, args.cap)
        if args.also:
            adversarial(f"ember redaction from {args.also}", module_redact(args.also), args.repeats, args.cap)
        return
    planted_docs, clean_docs = planted(), clean(args.stdlib_files)
    size = sum(len(d.text.encode("utf-8")) for d in planted_docs + clean_docs)
    print(f"labelled set: {len(planted_docs)} planted files ({sum(len(d.secrets) for d in planted_docs)} secrets), "
          f"{len(clean_docs)} clean files, {size / 1e6:.2f} MB; Python {sys.version.split()[0]}")
    tools = [("ember redaction", ember_tool()), ("datatrove PIIFormatter", datatrove_tool())]
    if args.also:
        tools.append((f"ember redaction from {args.also}", ember_tool(module_redact(args.also))))
    rates = throughput({name: redact_text for name, (redact_text, _) in tools}, planted_docs + clean_docs, args.repeats)
    recall = {}
    for name, (redact_text, hits) in tools:
        result = score(redact_text, hits, planted_docs, clean_docs)
        recall[name] = result.recall
        report(name, result, rates[name])
    figures = [Figure("MB per CPU-second", "MB/CPU-s", rates["ember redaction"], rates["datatrove PIIFormatter"],
                      "datatrove PIIFormatter", repeats=args.repeats),
               Figure("recall on planted secrets", "share", recall["ember redaction"], recall["datatrove PIIFormatter"],
                      "datatrove PIIFormatter")]
    write_results(args.results, "bench_redaction", args.profile, figures, stdlib_files=args.stdlib_files, mb=size / 1e6)


if __name__ == "__main__":
    main()
