"""Tokenize + pack at >= 100 M tokens: tokens/s per core, ember's whole run against raw encode and datatrove.

The input (code + web) is generated once from what this machine has and cached in `--work`: code is one
document per Python source file of the standard library and of the installed packages; web is pages cut
at log-normal lengths from the prose `ember.demo.sample_documents.web_documents` builds (documentation
topics, package descriptions, docstrings). It is written as Parquet row groups of the batch size while it
is generated, never held whole. Documents whose text holds the end-of-text token's characters are left
out (ember encodes them as ordinary text, the others would emit the special id: the ids would differ), and
so are repeated texts (ember keeps one of two documents with the same id), so that every method encodes
exactly the same ids; the run checks that their token counts agree.

Methods, each with the same tokenizer file (a 32k byte-level BPE trained here once on the input: no model
hub is reachable), the same batch size (ember's default `encode_batch_documents`) and one thread
(TOKENIZERS_PARALLELISM=false, RAYON_NUM_THREADS=1):
  raw       - tokenizers' `encode_batch` + ids, reading the same Parquet, with ember's tokenizer settings (the
              ceiling: the call ember makes); raw_bare (not run by default) is the tokenizer as the file loads
  datatrove - `DocumentTokenizer.run` on one worker in its fastest documented form (no shuffle, no loss or
              final metadata), fed from the same Parquet
  megatron  - per-document encode + megatron-core `IndexedDatasetBuilder` (tools/preprocess_data.py's loop)
  ember     - the whole `ember corpus tokenize` (`run` on FnApiRunner: read, tokenize, best-fit pack, global
              shuffle, zstd Arrow shards, manifest)
How every method is counted alike: each run is a fresh Python process that imports its libraries first and
then times only the method; CPU is that process's user + system time over all its threads plus any children
it waited for (getrusage), so a thread pool or a worker process cannot hide work; repeats interleave with the
order rotated, and the figure is the median. tokens/s per core = tokens / CPU-seconds.

    .venv/bin/python bench/bench_tokenize_pack.py --profile quick|full [--results FILE] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core each
os.environ["RAYON_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402

EOS = "<|endoftext|>"
BATCH = 2048  # ember's default encode_batch_documents (checked against the config in `main`)
CHARS_PER_TOKEN = 4.0  # measured on this input with the 32k tokenizer; sizes the input for a token target
TRAIN_CHARS = 24_000_000  # the tokenizer is trained on the input's first characters, once
PAGES_PER_CALL = 5000  # web pages generated per call, so the pages in memory stay ~25 MB
METHODS = ("raw", "datatrove", "megatron", "ember", "ember_fixed", "raw_bare")
DEFAULT_METHODS = METHODS[:5]
QUICK_METHODS = ("raw", "datatrove", "ember", "ember_fixed")  # megatron's torch start-up is a third of a quick run; no target
FIXED_COST_DOCUMENTS = 12  # per source: the input of `ember_fixed`, where the pipeline's fixed cost is nearly all
INPUT_VERSION = 2  # bump when the generated input changes, so a cached work dir is rebuilt


def log(message: str) -> None:
    print(message, flush=True)


# --- the input -----------------------------------------------------------------------------------------------


def code_paths() -> list[Path]:
    """Every Python source file of the standard library and of the installed packages, in a fixed order."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    seen: set[Path] = set()
    paths = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            real = path.resolve()
            if real not in seen and "__pycache__" not in path.parts:
                seen.add(real)
                paths.append(path)
    return paths


def code_texts():
    for path in code_paths():
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def web_texts():
    """Pages from `web_documents`, a few thousand per call with a new seed each time (a new cut of the prose)."""
    from ember.demo.sample_documents import web_documents

    seed = 0
    while True:
        for document in web_documents(PAGES_PER_CALL, seed=seed):
            yield document.text
        seed += 1


def write_source(out: Path, name: str, texts, budget_chars: int) -> dict:
    """`texts` as Document Parquet in row groups of BATCH rows until `budget_chars`; returns what was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ember.schemas.documents import DOCUMENT_SCHEMA, Document

    out.mkdir(parents=True, exist_ok=True)
    kind = "code" if name == "code" else "web"
    written = {"documents": 0, "chars": 0, "skipped_eos_text": 0, "skipped_repeat": 0}
    ids: set[str] = set()
    rows: list[dict] = []
    with pq.ParquetWriter(out / "part-0.parquet", DOCUMENT_SCHEMA, compression="zstd") as writer:
        for text in texts:
            if written["chars"] >= budget_chars:
                break
            if not text.strip():
                continue
            if EOS in text:
                written["skipped_eos_text"] += 1
                continue
            document = Document(source=name, kind=kind, text=text)
            if document.id in ids:
                written["skipped_repeat"] += 1
                continue
            ids.add(document.id)
            rows.append(document.to_row())
            written["documents"] += 1
            written["chars"] += len(text)
            if len(rows) == BATCH:
                writer.write_table(pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA))
                rows = []
        if rows:
            writer.write_table(pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA))
    return written


def iter_texts(work: Path, source: str | None = None):
    """Every text of the input, row group by row group (a list of at most BATCH texts each), code then web."""
    import pyarrow.parquet as pq

    for name in (source,) if source else ("code", "web"):
        handle = pq.ParquetFile(work / "in" / name / "part-0.parquet")
        for batch in handle.iter_batches(batch_size=BATCH, columns=["text"]):
            yield batch.column(0).to_pylist()


def train_tokenizer(work: Path, path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        chars = 0
        for name in ("code", "web"):
            for texts in iter_texts(work, name):
                yield from texts
                chars += sum(map(len, texts))
                if chars >= TRAIN_CHARS // 2:
                    break
            chars = 0

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sample(), trainer)
    tokenizer.save(str(path))


def prepare(work: Path, tokens: int, vocab: int) -> dict:
    """The cached input for a token target: generated on first use, reused after (its description in input.json)."""
    done = work / "input.json"
    if done.exists():
        described = json.loads(done.read_text())
        if described.get("version") == INPUT_VERSION and described.get("target_tokens") == tokens:
            return described
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    budget = int(tokens * CHARS_PER_TOKEN / 2)
    start = time.perf_counter()
    described = {"version": INPUT_VERSION, "target_tokens": tokens,
                 "code": write_source(work / "in" / "code", "code", code_texts(), budget),
                 "web": write_source(work / "in" / "web", "web", web_texts(), budget)}
    log(f"input generated in {time.perf_counter() - start:.0f}s: {described['code']} {described['web']}")
    start = time.perf_counter()
    train_tokenizer(work, work / "tokenizer.json", vocab)
    log(f"tokenizer trained in {time.perf_counter() - start:.0f}s")
    done.write_text(json.dumps(described))
    return described


# --- the methods, each run in a fresh process (`--child`) -----------------------------------------------------


def run_raw(work: Path, bare: bool = False) -> int:
    """The call ember makes: `encode_batch` with ember's settings (text is text; a post-processor that adds nothing,
    which makes the library faster); `bare` is the tokenizer as the file loads, the old bench's ceiling."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
    if not bare:
        tokenizer.encode_special_tokens = True
        tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B")
    tokens = 0
    for texts in iter_texts(work):
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            tokens += len(encoding.ids) + 1  # + EOS, to count like the others
    return tokens


def run_datatrove(work: Path) -> int:
    from datatrove.data import Document
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    out = fresh(work / "out-datatrove")
    step = DocumentTokenizer(str(out), tokenizer_name_or_path=str(work / "tokenizer.json"), eos_token=EOS, seed=0,
                             batch_size=BATCH, shuffle_documents=False, save_loss_metadata=False, save_final_metadata=False)
    documents = (Document(text=t, id=str(i)) for i, t in enumerate(t for texts in iter_texts(work) for t in texts))
    step.run(documents, rank=0, world_size=1)
    return sum(f.stat().st_size for f in out.glob("*.ds")) // step.token_size


def run_megatron(work: Path) -> int:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
    eod = tokenizer.token_to_id(EOS)
    out = fresh(work / "out-megatron") / "set"
    builder = IndexedDatasetBuilder(f"{out}.bin", dtype=DType.optimal_dtype(tokenizer.get_vocab_size()))
    tokens = 0
    for texts in iter_texts(work):
        for text in texts:  # preprocess_data.py: Encoder.encode per document, then add_document
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            ids.append(eod)
            builder.add_document(ids, [len(ids)])
            tokens += len(ids)
    builder.finalize(f"{out}.idx")
    return tokens


def write_fixed_cost_input(work: Path) -> None:
    """The FIXED_COST_DOCUMENTS shortest documents of each source's first row group, for `ember_fixed` (written once)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    for name in ("code", "web"):
        path = work / "tiny" / name / "part-0.parquet"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            table = pq.ParquetFile(work / "in" / name / "part-0.parquet").read_row_group(0)
            shortest = pc.sort_indices(pc.utf8_length(table["text"]))[:FIXED_COST_DOCUMENTS]
            pq.write_table(table.take(shortest), path)


def ember_settings(work: Path, seq_len: int, inputs: str = "in") -> dict:
    return {
        "output_dir": str(work / f"out-ember-{inputs}"),
        "seq_len": seq_len,
        "tokenizer": {"kind": "huggingface", "path": str(work / "tokenizer.json"), "eos_token": EOS},
        "sources": [{"name": name, "path": str(work / inputs / name / "*.parquet"), "weight": 0.5} for name in ("code", "web")],
    }


def run_ember(work: Path, seq_len: int, inputs: str = "in") -> int:
    """`ember corpus tokenize` minus the CLI: `run` loads the tokenizer, checks the input, runs the graph."""
    from ember.pipelines.tokenize_pipeline import run
    from ember.tokenize.config import parse_config

    manifest = run(parse_config(ember_settings(work, seq_len, inputs)), overwrite=True)
    return sum(s.tokens for s in manifest.sources.values())


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def cpu_seconds() -> float:
    """User + system time of this process (every thread) and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child(method: str, work: Path, seq_len: int) -> None:
    """One timed run of `method`, its imports done first (start-up, untimed for every method); prints one JSON line."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from loguru import logger

    import pyarrow.parquet  # noqa: F401  (every method reads the input with it)

    imports = {"datatrove": "datatrove.pipeline.tokens.tokenizer", "megatron": "megatron.core.datasets.indexed_dataset"}
    importlib.import_module(imports.get(method, "ember.pipelines.tokenize_pipeline" if "ember" in method else "tokenizers"))
    if "ember" in method:  # Beam imports its runner when the pipeline is made: an import like the others
        importlib.import_module("apache_beam.runners.portability.fn_api_runner")
    logger.remove()  # datatrove logs every step at INFO
    fn = {"raw": run_raw, "datatrove": run_datatrove, "megatron": run_megatron, "ember": lambda w: run_ember(w, seq_len),
          "ember_fixed": lambda w: run_ember(w, seq_len, "tiny"), "raw_bare": lambda w: run_raw(w, bare=True)}[method]
    threads = len(os.listdir("/proc/self/task"))
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokens = fn(work)
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    print(json.dumps({"method": method, "tokens": tokens, "cpu": cpu, "wall": wall, "threads_before": threads,
                      "threads_after": len(os.listdir("/proc/self/task")),
                      "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_child(method: str, work: Path, seq_len: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", method, "--work", str(work), "--seq-len", str(seq_len)],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser)
    parser.add_argument("--tokens", type=int, default=None, help="token target of the input (default: by profile)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: quick "
                        f"{','.join(QUICK_METHODS)}, otherwise {','.join(DEFAULT_METHODS)})")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--work", type=Path, default=None,
                        help="cached input directory (default: ~/.cache/ember/bench-tokenize-<tokens>)")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = args.tokens or profile_default(args.profile, 1_500_000, 105_000_000, default=1_500_000)
    work = args.work or Path.home() / ".cache" / "ember" / f"bench-tokenize-{tokens}"
    if args.child:
        child(args.child, work, args.seq_len)
        return
    from ember.tokenize.config import TokenizeConfig

    assert TokenizeConfig.model_fields["encode_batch_documents"].default == BATCH, "BATCH must be ember's default"
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(
        profile_default(args.profile, QUICK_METHODS, DEFAULT_METHODS))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    described = prepare(work, tokens, args.vocab)
    write_fixed_cost_input(work)
    log(f"input: {work} (code {described['code']['documents']} files, web {described['web']['documents']} pages, "
        f"{(described['code']['chars'] + described['web']['chars']) / 1e6:.0f} M characters); load average "
        f"{os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods):] + methods[: repeat % len(methods)]  # rotated: no method always first
        for method in order:
            result = run_child(method, work, args.seq_len)
            runs[method].append(result)
            log(f"  repeat {repeat + 1} {method:9} {result['tokens']:>12,} tokens {result['cpu']:8.1f} CPU-s "
                f"{result['wall']:8.1f} s wall  {result['tokens'] / result['cpu']:10,.0f} tokens/s per core  "
                f"threads {result['threads_before']}->{result['threads_after']}  max RSS {result['max_rss_mib']:,.0f} MiB")
    report(runs, args, described, work)


def report(runs: dict[str, list[dict]], args, described: dict, work: Path) -> None:
    fixed = runs.pop("ember_fixed", None)
    counts = {m: {r["tokens"] for r in rs} for m, rs in runs.items()}
    if len({c for cs in counts.values() for c in cs}) > 1:
        raise SystemExit(f"the methods encoded different token counts: {counts}")
    rate = {m: statistics.median(r["tokens"] / r["cpu"] for r in rs) for m, rs in runs.items()}
    load = os.getloadavg()
    print(f"\n## Tokens per CPU-second = tokens/s per core (median of {args.repeats}; one thread, batches of {BATCH}; "
          f"load average now {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    print(f"{'method':10} {'tokens':>12} {'median':>10} {'min':>10} {'max':>10} {'vs raw':>7} {'wall tok/s':>11} {'max RSS MiB':>12}")
    base = rate.get("raw")
    for method, rs in runs.items():
        rates = [r["tokens"] / r["cpu"] for r in rs]
        print(f"{method:10} {rs[0]['tokens']:12,} {rate[method]:10,.0f} {min(rates):10,.0f} {max(rates):10,.0f} "
              f"{rate[method] / base if base else float('nan'):7.1%} {statistics.median(r['tokens'] / r['wall'] for r in rs):11,.0f} "
              f"{max(r['max_rss_mib'] for r in rs):12,.0f}")
    figures = []
    if "ember" in rate:
        for anchor, target in (("raw", 0.9), ("datatrove", 1.0), ("megatron", None)):
            if anchor in rate:
                print(f"ember / {anchor}: {rate['ember'] / rate[anchor]:.2f}x" + (f" (target {target}x)" if target else ""))
                figures.append(Figure(f"tokenize+pack tokens/s per core vs {anchor}", "tokens/s/core", rate["ember"], rate[anchor],
                                      anchor, repeats=args.repeats, target=target))
    fixed_cpu = statistics.median(r["cpu"] for r in fixed) if fixed else None
    if fixed_cpu is not None and "ember" in rate:
        ember_cpu = statistics.median(r["cpu"] for r in runs["ember"])
        marginal = runs["ember"][0]["tokens"] / (ember_cpu - fixed_cpu)
        print(f"ember fixed cost: {fixed_cpu:.2f} CPU-s ({2 * FIXED_COST_DOCUMENTS} documents: graph, bundles, tokenizer "
              f"load, manifest) = {fixed_cpu / ember_cpu:.0%} of the whole run; without it {marginal:,.0f} tokens/s per core"
              + (f" = {marginal / base:.1%} of raw" if base else "")
              + (f", {marginal / rate['datatrove']:.2f}x datatrove" if "datatrove" in rate else ""))
    write_results(args.results, "tokenize_pack", args.profile, figures, tokens=next(iter(counts.values()), {None}).pop(),
                  input=described, batch=BATCH, seq_len=args.seq_len, work=str(work), fixed_cost_cpu_s=fixed_cpu,
                  runs={m: [{k: r[k] for k in ("tokens", "cpu", "wall", "max_rss_mib")} for r in rs]
                        for m, rs in (runs | ({"ember_fixed": fixed} if fixed else {})).items()})

if __name__ == "__main__":
    main()
