"""`make bench`: every benchmark in one command, each in its own process, gathered into bench/results.json.

Each bench/bench_*.py runs as `python bench/bench_x.py --profile quick|full --results FILE` (the contract of
bench/benchkit.py) under a time limit, in a process group of its own so that a timed-out bench's children
(torchrun ranks, ETL processes, clusters it started) go with it. One progress line per bench; a bench that
exits non-zero, times out or writes no results file is recorded with the tail of its output, the others still
run, and the runner exits 1 at the end. The load average is taken before and after each bench because the
machine is shared: a figure means little without it.

    .venv/bin/python bench/run_all.py [--full] [--only NAME ...] [--skip NAME ...] [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from bench.benchkit import machine  # noqa: E402

# Per-bench wall-clock limits in seconds: quick is a share of a 15-minute run of all benchmarks on 2 cores.
LIMITS = {"quick": 240.0, "full": 7200.0}
TAIL_CHARS = 4000


def _names(names: list[str] | None) -> list[str]:
    """`etl`, `bench_etl` and `bench_etl.py` all name bench/bench_etl.py."""
    stems = [n.removesuffix(".py") for n in names or []]
    return [n if n.startswith("bench_") else f"bench_{n}" for n in stems]


def discover(bench_dir: Path, only: list[str] | None, skip: list[str] | None) -> tuple[list[Path], list[str]]:
    """The benchmarks to run in name order, and the `--only` / `--skip` names not found."""
    found = {p.stem: p for p in sorted(bench_dir.glob("bench_*.py"))}
    wanted, skipped = _names(only) or list(found), set(_names(skip))
    unknown = [n for n in [*wanted, *skipped] if n not in found]
    return [found[n] for n in dict.fromkeys(wanted) if n in found and n not in skipped], unknown


def tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-TAIL_CHARS:]


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the bench and everything in its session: SIGINT first, so its `finally` blocks stop what it started
    outside the group (a Flink cluster's daemons, topics), then SIGTERM, then SIGKILL for what is left."""
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_leftovers(pgid: int) -> None:
    """Whatever the bench left in its group once it is gone (multiprocessing helpers ignore SIGINT and SIGTERM) would
    hold cores through every later bench."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_one(script: Path, profile: str, limit: float, work: Path) -> dict:
    """One bench in its own process: its exit status, wall seconds, load averages, figures or output tail."""
    name = script.stem
    results, out, err = work / f"{name}.json", work / f"{name}.out", work / f"{name}.err"
    load_before = list(os.getloadavg())
    started = time.monotonic()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), "--profile", profile, "--results", str(results)],
                                cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            returncode = None
        except KeyboardInterrupt:  # the runner stopped (Ctrl-C, SIGTERM): its bench is in a session of its own
            stop_group(proc)
            kill_leftovers(proc.pid)
            raise
        kill_leftovers(proc.pid)
    wall = time.monotonic() - started
    record: dict = {"bench": name, "wall_s": round(wall, 2), "limit_s": limit, "exit_status": returncode,
                    "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())}
    if returncode is None:
        record["status"] = "timeout"
    elif returncode != 0:
        record["status"] = "failed"
    elif not results.exists():
        record["status"] = "no_results"
    else:
        try:
            payload = json.loads(results.read_text())
            record.update(status="ok", figures=payload.get("figures", []), details=payload.get("details", {}),
                          machine=payload.get("machine"))
        except json.JSONDecodeError as exc:
            record["status"] = "no_results"
            record["reason"] = f"{results.name}: not JSON ({exc})"
    if record["status"] != "ok":
        record["stderr_tail"] = tail(err)
        record["stdout_tail"] = tail(out)
    return record


def progress(i: int, n: int, record: dict) -> str:
    """One line per bench: name, elapsed, status, and its figures' ratios (ember over anchor, > 1 is better)."""
    ratios = [f"{f['metric']} {f['ratio']:.2f}x" for f in record.get("figures", []) if f.get("ratio") is not None][:3]
    if record["status"] != "ok":
        last = (record.get("stderr_tail") or record.get("stdout_tail") or "").strip().splitlines()
        ratios = [last[-1][:160]] if last else []
    return (f"[{i}/{n}] {record['bench']:<26} {record['wall_s']:7.1f} s  {record['status']:<10} "
            f"load {record['loadavg_after'][0]:.1f}  " + "; ".join(ratios))


def table(report: dict) -> str:
    """The run as a BENCHMARKS.md table: every figure with its bench's load average, under the profile and commit."""
    lines = [f"profile {report['profile']}, commit {report['commit']}{' (dirty)' if report['dirty'] else ''}, "
             f"{report['cores']} cores, {report['wall_s']:.0f} s in all",
             "", "| bench | status | wall s | load before / after | metric | ember | anchor | ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in report["benches"]:
        head = (f"| {r['bench']} | {r['status']} | {r['wall_s']:.0f} | "
                f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |")
        figures = r.get("figures") or [None]
        for f in figures:
            if f is None:
                lines.append(f"{head} - | - | - | - |")
                continue
            anchor = f"{f['anchor']:.4g} ({f['anchor_name']})" if f.get("anchor") is not None else "-"
            ratio = f"{f['ratio']:.2f}x" if f.get("ratio") is not None else "-"
            cells = (f["metric"], f"{f['ember']:.4g} {f['unit']}", anchor, ratio)
            lines.append(f"{head} " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full sizes the issues name (hours), not the quick profile")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (e.g. codec bench_etl)")
    parser.add_argument("--skip", nargs="+", metavar="NAME", help="run all but these benchmarks")
    parser.add_argument("--out", type=Path, default=BENCH / "results.json", help="where the gathered results go")
    parser.add_argument("--limit", type=float, default=None,
                        help=f"seconds per bench before it is stopped (default quick {LIMITS['quick']:.0f}, "
                             f"full {LIMITS['full']:.0f})")
    parser.add_argument("--bench-dir", type=Path, default=BENCH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be > 0, got {args.limit}")
    # A shell that starts the runner in the background leaves SIGINT ignored, and its children would inherit that:
    # a handled SIGINT is reset to the default at exec, so each bench gets its KeyboardInterrupt (and its cleanup).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` and `kill` stop the running bench too
    profile = "full" if args.full else "quick"
    limit = args.limit or LIMITS[profile]
    scripts, unknown = discover(args.bench_dir, args.only, args.skip)
    if unknown:
        parser.error(f"no benchmark named {', '.join(unknown)} in {args.bench_dir}")
    started = time.monotonic()
    report = {"profile": profile, "started": datetime.now(UTC).isoformat(timespec="seconds"), **machine(),
              "limit_s": limit, "benches": []}
    print(f"make bench: {len(scripts)} benchmarks, profile {profile}, {limit:.0f} s limit each, commit "
          f"{report['commit']}{' (dirty)' if report['dirty'] else ''}, load {report['loadavg'][0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        for i, script in enumerate(scripts, 1):
            record = run_one(script, profile, limit, Path(tmp))
            report["benches"].append(record)
            print(progress(i, len(scripts), record), flush=True)
            report["wall_s"] = round(time.monotonic() - started, 1)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each bench: a stopped run keeps its part
    bad = [r["bench"] for r in report["benches"] if r["status"] != "ok"]
    print("\n" + table(report) + "\n", flush=True)
    print(f"{len(scripts) - len(bad)} of {len(scripts)} ok in {report['wall_s']:.0f} s; load {os.getloadavg()[0]:.1f}; "
          f"written {args.out}" + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
