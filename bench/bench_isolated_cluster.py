"""A tokenize build on a Flink cluster whose workers share no disk with the driver, against FnApiRunner.

Starts its own isolated session cluster (infra/flink-cluster.sh with EMBER_FLINK_ISOLATED=1 on free ports: the worker
pool under bubblewrap, a private /tmp), uploads --copies x the tokenize test documents to a fresh gs:// and s3://
bucket of the local object stores (`ember dev up` started them), and per scheme runs the same tokenize to a URL
output on FnApiRunner (anchor, in this process) and on the cluster (ember's distributed path). Reported per run: wall
seconds, the set's bytes (shards + rejects + manifest), and per SDK harness process of the cluster the bytes it wrote
(`/proc/PID/io` wchar: every write call, sockets included - its uploads to the store and its data plane to the
TaskManager); and the manifest commit's own cost, timed on the finished set: the size check of every shard at the
location (one listing) and the manifest's write, the two calls the job's last step makes. The cluster is stopped at
the end. Timing never decides pass/fail.

    EMBER_HOME=/path/to/.ember .venv/bin/python bench/bench_isolated_cluster.py [--copies 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember import storage  # noqa: E402
from ember.dev import services  # noqa: E402
from ember.pipelines.jobs import set_commit  # noqa: E402
from ember.pipelines.tokenize_pipeline import run as tokenize  # noqa: E402
from ember.schemas.shards import MANIFEST_FILENAME  # noqa: E402
from ember.tokenize.config import TokenizeConfig  # noqa: E402
from tests.conftest import _new_bucket  # noqa: E402
from tests.ports import free_ports  # noqa: E402
from tests.tokenize.support import mixed_documents, write_documents  # noqa: E402

SCRIPT = ROOT / "infra" / "flink-cluster.sh"
PORTS = ("RPC", "REST", "BLOB", "JOB", "ARTIFACT", "EXPANSION", "WORKER_POOL")


def harness_writes(pool_pid: int) -> dict[int, int]:
    """wchar of every process under the worker pool (bubblewrap -> pool -> SDK harnesses)."""
    found, todo = {}, [pool_pid]
    while todo:
        pid = todo.pop()
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        todo += [int(c) for c in children]
        try:
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            found[pid] = int(io["wchar"])
        except (OSError, KeyError):
            continue
    return found


def config(sources: dict[str, str], output_dir: str) -> TokenizeConfig:
    return TokenizeConfig(
        output_dir=output_dir, seq_len=128, window_documents=16, sequences_per_shard=8, rows_per_batch=4, seed=3,
        tokenizer={"name": "cl100k_base"}, sources=[{"name": n, "path": p} for n, p in sources.items()],
    )


def commit_cost(location: str, repeats: int = 5) -> float:
    """Median seconds of the last step's two store calls on a finished set: the size check and the manifest write."""
    manifest = storage.read_bytes(storage.join(location, MANIFEST_FILENAME))
    sizes = {n: s for n, s in storage.list_files(location).items() if n != MANIFEST_FILENAME}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        set_commit.check_written(location, sizes)
        set_commit.write_file(location, MANIFEST_FILENAME, manifest)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=None,
                        help="copies of the test documents, each copy's texts differ (quick 1, full 4)")
    add_flags(parser)
    args = parser.parse_args()
    args.copies = args.copies or profile_default(args.profile, 1, 4)
    schemes = profile_default(args.profile, ("s3",), ("gs", "s3"))  # quick: one object store; the cluster's start dominates
    walls: dict[tuple[str, str], float] = {}
    os.environ.update(services.objectstores_env())
    env = {**os.environ, "EMBER_FLINK_CLUSTER": "flink-isolated-bench", "EMBER_FLINK_ISOLATED": "1"}
    env.update({f"EMBER_FLINK_{n}_PORT": str(p) for n, p in zip(PORTS, free_ports(len(PORTS)))})
    subprocess.run(["bash", str(SCRIPT), "start"], env=env, check=True, capture_output=True)
    try:
        cluster = subprocess.run(["bash", str(SCRIPT), "args"], env=env, check=True, capture_output=True,
                                 text=True).stdout.split()
        run_dir = Path(env.get("EMBER_HOME", ROOT / ".ember")) / "run" / env["EMBER_FLINK_CLUSTER"]
        pool = int((run_dir / "worker-pool.pid").read_text().split()[0])
        docs = mixed_documents(copies=args.copies)
        with tempfile.TemporaryDirectory(prefix="bench-isolated-") as tmp:
            files = {n: write_documents(Path(tmp) / n / "part-0.parquet", docs[n]) for n in ("code", "web")}
            print(f"{sum(len(v) for v in docs.values())} documents, {sum(p.stat().st_size for p in files.values()):,} "
                  "bytes of Parquet; medians of one run each (measured on a loaded machine)")
            for scheme in schemes:
                bucket = _new_bucket(scheme)
                storage.preflight(bucket, write=True)
                sources = {}
                for name, path in files.items():
                    storage.upload(path, f"{bucket}/in/{name}/part-0.parquet")
                    sources[name] = f"{bucket}/in/{name}/*.parquet"
                for label, beam_args in (("FnApiRunner", ["--runner=FnApiRunner"]), ("isolated cluster", cluster)):
                    out = f"{bucket}/{label.split()[0].lower()}"
                    before = harness_writes(pool)
                    started = time.perf_counter()
                    tokenize(config(sources, out), beam_args)
                    wall = time.perf_counter() - started
                    walls[scheme, label] = wall
                    written = sum(storage.list_files(out).values())
                    line = f"{scheme}:// {label:16s} {wall:6.1f} s, set {written:,} bytes"
                    if label != "FnApiRunner":
                        after = harness_writes(pool)
                        grew = sorted((after[p] - before.get(p, 0) for p in after if after[p] > before.get(p, 0)),
                                      reverse=True)
                        line += f"; written per harness process: {', '.join(f'{b:,}' for b in grew)}"
                    print(line)
                print(f"{scheme}:// manifest commit (size check + manifest write): {commit_cost(f'{bucket}/isolated') * 1000:.0f} ms")
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True)
    write_results(args.results, "bench_isolated_cluster", args.profile, [
        Figure(f"{scheme}:// tokenize wall s, isolated cluster", "s", walls[scheme, "isolated cluster"],
               walls[scheme, "FnApiRunner"], "FnApiRunner in process", higher_is_better=False)
        for scheme in schemes
    ], copies=args.copies)


if __name__ == "__main__":
    main()
