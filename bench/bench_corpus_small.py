"""A small corpus build's fixed cost: `ember corpus build` on ~2 MB of source files, main's way against the fused
build, with datatrove's local executor on the same documents as the anchor.

Input: the source trees of five installed packages (rich, jinja2, click, markupsafe, attrs; no __pycache__), read
as a `format: files` source - one document per file, as issue 35's user built from three packages. Each ember run
is the real command in a fresh process (`python -m ember.cli corpus build`), timed from start to exit, with a
`tokenize:` section (cl100k_base, 512-token rows) as the user had:

  before   `--phases=split --direct_running_mode=multi_processing --direct_num_workers=<cores>`: main's default,
           three Beam jobs (documents, output, tokenize) on FnApiRunner's multi-process SDK workers
  split    `--phases=split --runner=FnApiRunner`: the same three jobs in-process (the runner choice alone)
  after    no options: the default now, in-process, documents + output fused into one job, then tokenize

and `after` once more without `tokenize:`, the steps datatrove does too. datatrove's anchor runs in a fresh process
too: LocalPipelineExecutor (one worker) over the same documents packed into one Parquet file beforehand (it has
no reader of source trees; the packing is not timed), with the steps ember does: read -> code filter (ember's own
`check_code`, in a LambdaFilter, so the decision costs the same) -> PIIFormatter (emails, IPs) -> exact dedup
(signature, find, filter) -> MinHash near dedup (signature, buckets, cluster, filter; ember's 5-grams, 14 x 8)
-> ParquetWriter, each stage datatrove's own executor run. Reported: median wall seconds and CPU seconds (user +
sys of the whole process tree) of --repeats runs, the variants taking turns, the Beam jobs each ember run logged,
and the ratios. Timing never decides pass/fail.

    .venv/bin/python bench/bench_corpus_small.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

PACKAGES = ("rich", "jinja2", "click", "markupsafe", "attrs")
QUICK_PACKAGES = ("click", "markupsafe", "attrs")  # ~0.5 MB: the fixed cost still dominates, as in the full input
TOKENIZE = {"tokenizer": {"name": "cl100k_base"}, "seq_len": 512, "sequences_per_shard": 64}
JOB_LINE = re.compile(r"beam job started: (.+) on \w+ in process \d+$", re.MULTILINE)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402


def source_trees(directory: Path, packages: tuple[str, ...]) -> tuple[int, int]:
    """The packages' source trees copied under `directory`, one repository each; (files, bytes)."""
    for name in packages:
        root = importlib.util.find_spec(name).submodule_search_locations[0]
        shutil.copytree(root, directory / name, ignore=shutil.ignore_patterns("__pycache__"))
    files = [p for p in directory.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def pack(trees: Path, path: Path) -> None:
    """The trees as one Parquet file of documents (id, text, metadata), the input datatrove's reader takes."""
    rows = [{"id": str(p.relative_to(trees)), "text": p.read_bytes().decode("utf-8", "replace"),
             "path": str(p.relative_to(trees))} for p in sorted(trees.rglob("*")) if p.is_file()]
    pq.write_table(pa.Table.from_pylist(rows), path)


def ember_config(trees: Path, out: Path, tokenize: bool) -> dict:
    config = {"sources": [{"name": "code", "kind": "code", "inputs": [f"{trees}/*"], "format": "files", "weight": 1.0}],
              "output": {"directory": str(out)}}
    return {**config, "tokenize": TOKENIZE} if tokenize else config


def timed(command: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the process tree) of `command`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode != 0:
        raise RuntimeError(f"{command[:6]} failed (exit {child.returncode}):\n{child.stdout[-2000:]}{child.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_ember(trees: Path, work: Path, options: list[str], tokenize: bool) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / ".out-ember-cache", ignore_errors=True)
    config = work / "corpus.yaml"
    config.write_text(yaml.safe_dump(ember_config(trees, out, tokenize)))
    wall, cpu = timed([sys.executable, "-m", "ember.cli", "corpus", "build", str(config), *options])
    jobs = JOB_LINE.findall((work / "out.log").read_text())
    kept = json.loads((out / "stats.json").read_text())["totals"]["kept"]
    return {"wall": wall, "cpu": cpu, "jobs": jobs, "kept": kept}


@functools.cache
def _code_filters():
    from ember.pipelines.quality.settings import CodeFilters

    return CodeFilters()


def _code_kept(document) -> bool:
    from ember.pipelines.quality.code_filters import check_code, language_from_path

    path = document.metadata.get("path")
    return check_code(document.text, {"path": path, "language": language_from_path(path)}, _code_filters())[0] == ""


def _text(document) -> str:
    return document.text


def datatrove_child(parquet: str, out: str) -> None:
    """The anchor's stages, each one LocalPipelineExecutor run; prints the kept count."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupFilter, ExactDedupSignature, ExactFindDedups
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import LambdaFilter
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter
    from datatrove.utils.hashing import HashConfig

    from ember.pipelines.corpus.config import Dedup
    from ember.pipelines.quality.web_filters import RegexWordTokenizer

    dedup, tok, hashing = Dedup(), RegexWordTokenizer(), HashConfig(precision=64, hash_fc="sha1")  # no xxhash installed
    minhash = MinhashConfig(n_grams=dedup.n_grams, num_buckets=dedup.bands, hashes_per_bucket=dedup.rows_per_band,
                            seed=dedup.seed, hash_config=hashing)
    exact = ExactDedupConfig(content_getter=_text, hash_config=hashing)
    stages = [
        ([ParquetReader(str(Path(parquet).parent), glob_pattern=Path(parquet).name), LambdaFilter(_code_kept),
          PIIFormatter(), ParquetWriter(f"{out}/filtered", compression="zstd")], 1),
        ([ParquetReader(f"{out}/filtered"), ExactDedupSignature(f"{out}/exact_sigs", config=exact)], 1),
        ([ExactFindDedups(f"{out}/exact_sigs", f"{out}/exact_dups", config=exact)], 1),
        ([ParquetReader(f"{out}/filtered"), ExactDedupFilter(f"{out}/exact_dups", config=exact),
          ParquetWriter(f"{out}/exact", compression="zstd")], 1),
        ([ParquetReader(f"{out}/exact"), MinhashDedupSignature(f"{out}/sigs", config=minhash, language=tok)], 1),
        ([MinhashDedupBuckets(f"{out}/sigs", f"{out}/buckets", config=minhash)], dedup.bands),
        ([MinhashDedupCluster(f"{out}/buckets", f"{out}/remove", config=minhash)], 1),
        ([ParquetReader(f"{out}/exact"), MinhashDedupFilter(f"{out}/remove"), ParquetWriter(f"{out}/final", compression="zstd")], 1),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=f"{out}/logs/{i}").run()
    print(sum(pq.read_metadata(p).num_rows for p in Path(f"{out}/final").glob("*.parquet")))


def run_datatrove(parquet: Path, work: Path) -> dict:
    out = work / "datatrove"
    shutil.rmtree(out, ignore_errors=True)
    wall, cpu = timed([sys.executable, __file__, "_datatrove", str(parquet), str(out)])
    kept = sum(pq.read_metadata(p).num_rows for p in (out / "final").glob("*.parquet"))
    return {"wall": wall, "cpu": cpu, "jobs": [], "kept": kept}


def main() -> None:
    if sys.argv[1:2] == ["_datatrove"]:
        datatrove_child(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 2 (each run is a fresh CLI process), "
                        "otherwise 3")
    add_flags(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or profile_default(args.profile, 2, 3)
    packages = profile_default(args.profile, QUICK_PACKAGES, PACKAGES)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-corpus-small-") as tmp:
        work = Path(tmp)
        files, size = source_trees(work / "trees", packages)
        pack(work / "trees", work / "documents.parquet")
        variants = {
            "ember before (split, multi-process: main's default)": lambda: run_ember(
                work / "trees", work, ["--phases=split", "--runner=FnApiRunner", "--direct_running_mode=multi_processing",
                                       f"--direct_num_workers={cores}"], True),
            "ember split, in-process": lambda: run_ember(work / "trees", work, ["--phases=split", "--runner=FnApiRunner"], True),
            "ember after (default: fused, in-process)": lambda: run_ember(work / "trees", work, [], True),
            "ember after, no tokenize": lambda: run_ember(work / "trees", work, [], False),
            "datatrove LocalPipelineExecutor (1 worker)": lambda: run_datatrove(work / "documents.parquet", work),
        }
        if args.profile == "quick":  # the headline pair only: ember's default build without tokenize, and datatrove
            variants = {k: v for k, v in variants.items() if k.startswith(("ember after, no", "datatrove"))}
        print(f"# bench_corpus_small: {files} files, {size / 1e6:.2f} MB ({', '.join(packages)}), {cores} cores, "
              f"load {os.getloadavg()[0]:.1f}, median of {args.repeats}\n")
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # the variants take turns, so a burst of load on the shared machine hits each alike
            for name, run in variants.items():
                runs[name].append(run())
        print("| run | wall s | CPU s | Beam jobs | kept |")
        print("|---|---|---|---|---|")
        medians = {}
        for name, done in runs.items():
            medians[name] = {k: statistics.median(r[k] for r in done) for k in ("wall", "cpu")}
            jobs = " + ".join(done[0]["jobs"]) or "-"
            print(f"| {name} | {medians[name]['wall']:.1f} | {medians[name]['cpu']:.1f} | {len(done[0]['jobs']) or '-'} ({jobs}) | "
                  f"{done[0]['kept']} |")
        bare, anchor = medians["ember after, no tokenize"], medians["datatrove LocalPipelineExecutor (1 worker)"]
        before = medians.get("ember before (split, multi-process: main's default)")
        after = medians.get("ember after (default: fused, in-process)")
        if before and after:
            print(f"\nbefore / after: {before['wall'] / after['wall']:.2f}x wall, {before['cpu'] / after['cpu']:.2f}x CPU")
        print(f"ember after without tokenize / datatrove: {bare['wall'] / anchor['wall']:.2f}x wall, "
              f"{bare['cpu'] / anchor['cpu']:.2f}x CPU (load average {os.getloadavg()[0]:.1f} at the end)")
    dt = "datatrove LocalPipelineExecutor (1 worker)"
    write_results(args.results, "bench_corpus_small", args.profile, [
        Figure("build wall s, no tokenize", "s", bare["wall"], anchor["wall"], dt, higher_is_better=False, repeats=args.repeats),
        Figure("build CPU s, no tokenize", "CPU s", bare["cpu"], anchor["cpu"], dt, higher_is_better=False, repeats=args.repeats),
    ], files=files, bytes=size, packages=list(packages), medians=medians)


if __name__ == "__main__":
    main()
