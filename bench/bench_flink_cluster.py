"""Corpus build on the Flink session cluster against FnApiRunner: wall, docs/s, CPU, bytes shuffled per stage.

The input is issue 3's web set (bench_corpus_dedup.web_corpus: --docs filter-passing pages with planted
exact and near duplicates, in --files zstd Parquet files); the build is the same as that bench's (read,
quality filters, exact dedup, MinHash near dedup, write; redaction off). Three runs, one each:

  fnapi-1   FnApiRunner in this process (one worker)
  flink-1   the session cluster of infra/flink-cluster.sh restarted with EMBER_FLINK_TASKMANAGERS=1
  flink-2   the same with 2 TaskManagers (parallelism 2); the cluster is left with 2, as `ember dev up` starts it

CPU seconds are counted two ways, because the work runs in other processes (JobManager, TaskManagers,
job server, the worker pool's SDK harnesses): `machine` is the whole machine's non-idle CPU time over
the run (psutil.cpu_times, so it includes anything else the machine ran meanwhile), `ember` is this
process plus every process of the cluster (its pid files and their children). Bytes shuffled are
Flink's own counters from the REST API's /jobs/<id>: `shuffled` is the `write-bytes` of each vertex that
feeds a repartitioning edge (hash partition for a GroupByKey, broadcast, rebalance), summed per ember
transform; `passed between vertices` adds the forward edges (serialised through Flink's network stack
too, but not repartitioned). Each run is one Beam job, the whole graph (corpus_pipeline.run, what a
build to gs:// or s3:// submits; `ember corpus build` to a local directory splits it into two jobs with
a phase cache between). FnApiRunner's in-process exchange has no such counter. The projection to
--project documents scales the 2-TaskManager run's per-document costs linearly (see `projection`).
Restarting the cluster stops any job on it.

    EMBER_HOME=... .venv/bin/python bench/bench_flink_cluster.py [--docs 4000] [--files 4] [--skip-fnapi]
        [--marginal-from bench/results/flink_cluster_400.json]   # the results of a smaller --docs run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # this checkout's ember
sys.path.insert(0, str(BENCH))

from bench_corpus_dedup import BANDS, N_GRAMS, ROWS, SEED, web_corpus  # noqa: E402

from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.dev import services  # noqa: E402
from ember.pipelines.corpus.config import check_inputs, parse_config  # noqa: E402
from ember.pipelines.corpus.pipeline import run  # noqa: E402
from ember.pipelines.corpus.report import read_stats  # noqa: E402
from ember.pipelines.jobs.runners import flink_cluster_args, local_args  # noqa: E402

REST = f"http://127.0.0.1:{os.environ.get('EMBER_FLINK_REST_PORT', '18081')}"
CLUSTER_PARTS = ("jobmanager", "job-server", "worker-pool")


def rest(path: str) -> dict:
    with urllib.request.urlopen(REST + path, timeout=10) as response:
        return json.load(response)


def config(input_dir: Path, out: Path):
    return parse_config({
        "sources": [{"name": "web", "kind": "web", "inputs": [f"{input_dir}/*.parquet"], "format": "parquet"}],
        "redaction": {"enabled": False},
        "dedup": {"n_grams": N_GRAMS, "bands": BANDS, "rows_per_band": ROWS, "seed": SEED},
        "output": {"directory": str(out)},
    })


def restart_cluster(taskmanagers: int) -> None:
    """Stop the session cluster and start it with `taskmanagers` TaskManagers (the script's own start)."""
    env = {**os.environ, "EMBER_FLINK_TASKMANAGERS": str(taskmanagers)}
    script = str(services.INFRA_DIR / "flink-cluster.sh")
    for command in ("stop", "start"):
        done = subprocess.run(["bash", script, command], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"infra/flink-cluster.sh {command} failed:\n{done.stdout}{done.stderr}")
    if rest("/overview")["taskmanagers"] != taskmanagers:
        raise RuntimeError(f"the cluster did not come back with {taskmanagers} TaskManagers: {rest('/overview')}")


def cluster_cpu() -> dict[int, float]:
    """CPU seconds so far of each process of the cluster (its pid files' processes and all their children)."""
    run_dir = Path(os.environ.get("EMBER_HOME", BENCH.parent / ".ember")) / "run" / "flink-cluster"
    seconds: dict[int, float] = {}
    for pid_file in run_dir.glob("*.pid"):
        try:
            root = psutil.Process(int(pid_file.read_text().split()[0]))
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                seconds[p.pid] = t.user + t.system + t.children_user + t.children_system
        except (psutil.Error, ValueError, IndexError):
            continue
    return seconds


def machine_busy() -> float:
    t = psutil.cpu_times()  # guest time is already inside user time
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def stage_of(vertex_name: str) -> str:
    """The ember transform a vertex belongs to: the GroupByKey it pre-combines for, else its first fused transform
    ("... GroupCombine: NearDedup/Components/Round0/... -> ...", "MapPartition at [6]{NearDedup, AllStats}")."""
    if "GroupCombine: " in vertex_name:
        target = vertex_name.split("GroupCombine: ", 1)[1]
    else:
        target = vertex_name.split(" at ", 1)[-1]
    name = re.split(r"[/,{}() ]", re.sub(r"^\[\d+\]\{?", "", target), maxsplit=1)[0]
    return "other" if not name or name.startswith("ExtractOutput") else name  # Beam's multi-output plumbing


def exchanged(jobs: list[str]) -> tuple[dict[str, int], int]:
    """Bytes shuffled per ember transform (`write-bytes` of every vertex that feeds a hash partition, broadcast or
    rebalance), and all bytes passed between vertices (forward edges included), over every vertex of `jobs`."""
    per_stage: dict[str, int] = defaultdict(int)
    total = 0
    for jid in jobs:
        job = rest(f"/jobs/{jid}")
        repartitioning = {edge["id"] for node in job["plan"]["nodes"] for edge in node.get("inputs", [])
                          if edge.get("ship_strategy") != "Forward"}
        for vertex in job["vertices"]:
            written = int(vertex["metrics"].get("write-bytes", 0))
            total += written
            if vertex["id"] in repartitioning:
                per_stage[stage_of(vertex["name"])] += written
    return dict(per_stage), total


def one_run(name: str, args: list[str], input_dir: Path, work: Path, docs: int) -> dict:
    out = work / name
    corpus = config(input_dir, out)
    check_inputs(corpus)
    on_flink = name.startswith("flink")
    known = {j["jid"] for j in rest("/jobs/overview")["jobs"]} if on_flink else set()
    me = psutil.Process()
    cluster_before = cluster_cpu() if on_flink else {}
    mine_before, busy_before = sum(me.cpu_times()[:2]), machine_busy()
    start = time.perf_counter()
    state = run(corpus, PipelineOptions(args))
    wall = time.perf_counter() - start
    busy = machine_busy() - busy_before
    mine = sum(me.cpu_times()[:2]) - mine_before
    cluster = sum(s - cluster_before.get(pid, 0.0) for pid, s in (cluster_cpu() if on_flink else {}).items())
    if state != "DONE":
        raise RuntimeError(f"{name}: the build ended in state {state}")
    jobs = [j["jid"] for j in rest("/jobs/overview")["jobs"] if j["jid"] not in known] if on_flink else []
    stats = read_stats(str(out))["totals"]
    shutil.rmtree(out, ignore_errors=True)
    per_stage, between = exchanged(jobs) if on_flink else ({}, 0)
    return {
        "run": name, "wall_s": wall, "docs_per_s": docs / wall, "machine_cpu_s": busy, "ember_cpu_s": mine + cluster,
        "kept": stats["kept"], "flink_jobs": jobs, "shuffled_bytes": per_stage,
        "shuffled_total": sum(per_stage.values()), "between_vertices_total": between,
    }


def projection(run: dict, docs: int, input_bytes: int, target: int, ratio: float, smaller: dict | None) -> dict:
    """A `target`-document build from `run`'s per-document costs, linearly.

    Assumes: documents like these (input_bytes / docs each; cost grows with bytes, so 4x longer documents
    cost ~4x); every stage linear in N (the cost model in BENCHMARKS.md: B x N band keys, star edges,
    at most max_cc_rounds rounds over <= E edges); one core per worker (one slot per TaskManager). Per
    document is either the run's average (its fixed start-up spread over the documents: an upper bound)
    or, given the same run at a smaller size (`smaller`, a results file's run), the marginal cost
    between the two sizes. Workers are given at the parallel efficiency measured from 1 to 2
    TaskManagers (ratio / 2, capped at 1) and at 1 (each TaskManager on cores of its own).
    """
    if smaller:
        extra = docs - smaller["docs"]
        cpu_per_doc = (run["ember_cpu_s"] - smaller["ember_cpu_s"]) / extra
        shuffle_per_doc = (run["shuffled_total"] - smaller["shuffled_total"]) / extra
    else:
        cpu_per_doc, shuffle_per_doc = run["ember_cpu_s"] / docs, run["shuffled_total"] / docs
    measured = min(1.0, ratio / 2)
    cpu_hours = cpu_per_doc * target / 3600
    return {
        "documents": target, "per_document": "marginal" if smaller else "average",
        "bytes_per_document": input_bytes / docs, "cpu_s_per_document": cpu_per_doc, "cpu_hours": cpu_hours,
        "measured_parallel_efficiency": measured,
        "workers_for_hours": {f"{hours}h_efficiency_{e:.2f}": math.ceil(cpu_hours / hours / e)
                              for hours in (24, 72) for e in (measured, 1.0)},
        "shuffle_bytes": shuffle_per_doc * target,
    }


def table(runs: list[dict]) -> str:
    lines = ["| run | wall s | docs/s | machine CPU s | ember CPU s | kept | shuffled MB | passed between vertices MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        mb = (f"{r['shuffled_total'] / 1e6:.3f} | {r['between_vertices_total'] / 1e6:.3f}" if r["flink_jobs"]
              else "n/a (in process) | n/a")
        lines.append(f"| {r['run']} | {r['wall_s']:.1f} | {r['docs_per_s']:.1f} | {r['machine_cpu_s']:.1f} | "
                     f"{r['ember_cpu_s']:.1f} | {r['kept']} | {mb} |")
    flink = [r for r in runs if r["flink_jobs"]]
    if flink:
        stages = sorted({s for r in flink for s in r["shuffled_bytes"]}, key=lambda s: -flink[-1]["shuffled_bytes"].get(s, 0))
        lines += ["", "| stage (shuffled) | " + " | ".join(f"{r['run']} MB" for r in flink) + " |",
                  "|---|" + "---|" * len(flink)]
        lines += [f"| {stage} | " + " | ".join(f"{r['shuffled_bytes'].get(stage, 0) / 1e6:.3f}" for r in flink) + " |"
                  for stage in stages]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=None, help="web documents (quick 800; full: issue 3's set, 4000)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--project", type=int, default=10**9, help="documents of the projected build")
    p.add_argument("--skip-fnapi", action="store_true")
    p.add_argument("--marginal-from", type=Path,
                   help="a results JSON of a smaller --docs run: project from the cost between the two sizes")
    p.add_argument("--results-dir", type=Path, default=BENCH / "results", help="where the runs' JSON is kept")
    add_flags(p)
    args = p.parse_args()
    args.docs = args.docs or profile_default(args.profile, 800, 4000)
    work = Path(tempfile.mkdtemp(prefix="ember-bench-flink-"))
    runs: list[dict] = []
    try:
        input_bytes, _planted = web_corpus(work / "web", args.docs, args.files)
        print(f"# bench_flink_cluster: {args.docs} web documents ({input_bytes / 1e6:.2f} MB) in {args.files} files, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start", flush=True)
        if not args.skip_fnapi:
            runs.append(one_run("fnapi-1", local_args(1), work / "web", work, args.docs))
        for taskmanagers in (1, 2):
            restart_cluster(taskmanagers)
            cluster = flink_cluster_args({**os.environ, "EMBER_FLINK_TASKMANAGERS": str(taskmanagers)})
            runs.append(one_run(f"flink-{taskmanagers}", cluster, work / "web", work, args.docs))
            print(f"{runs[-1]['run']}: {runs[-1]['wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if rest("/overview")["taskmanagers"] != 2:
            restart_cluster(2)
    by_name = {r["run"]: r for r in runs}
    ratio = by_name["flink-1"]["wall_s"] / by_name["flink-2"]["wall_s"]
    smaller = None
    if args.marginal_from:
        earlier = json.loads(args.marginal_from.read_text())
        smaller = {**next(r for r in earlier["runs"] if r["run"] == "flink-2"), "docs": earlier["docs"]}
    projected = projection(by_name["flink-2"], args.docs, input_bytes, args.project, ratio, smaller)
    print()
    print(table(runs))
    print(f"\nscaling 2 TM / 1 TM (wall of 1 TM / wall of 2 TM): {ratio:.2f}x; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    workers = ", ".join(f"{k}: {v:,}" for k, v in projected["workers_for_hours"].items())
    print(f"\nprojection ({projected['per_document']} cost per document), {args.project:.0e} documents of "
          f"{projected['bytes_per_document']:.0f} B: {projected['cpu_hours']:,.0f} CPU hours "
          f"({projected['cpu_s_per_document'] * 1e3:.2f} CPU ms per document); workers {workers}; "
          f"shuffle {projected['shuffle_bytes'] / 1e12:.2f} TB")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    result = args.results_dir / f"flink_cluster_{args.docs}.json"
    result.write_text(json.dumps({
        "docs": args.docs, "files": args.files, "input_bytes": input_bytes, "cores": os.cpu_count(),
        "load_average_end": os.getloadavg(), "runs": runs, "scaling_2tm_over_1tm": ratio, "projection": projected,
    }, indent=1) + "\n")
    print(f"\nwritten: {result}")
    write_results(args.results, "bench_flink_cluster", args.profile, [
        Figure("docs/s, Flink session cluster with 2 TaskManagers", "docs/s", by_name["flink-2"]["docs_per_s"],
               by_name.get("fnapi-1", {}).get("docs_per_s"), "FnApiRunner in process (1 worker)"),
        Figure("docs/s, 2 TaskManagers", "docs/s", by_name["flink-2"]["docs_per_s"], by_name["flink-1"]["docs_per_s"],
               "1 TaskManager"),
    ], docs=args.docs, files=args.files, input_bytes=input_bytes, runs=runs)


if __name__ == "__main__":
    main()
