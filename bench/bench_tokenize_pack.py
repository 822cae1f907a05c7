"""Tokenize + pack: fill ratio and tokens/s per core, ember vs the tools users compare it with.

One run, same texts, same tokenizer (a 32k byte-level BPE trained here on the corpus: no model hub
is reachable), every tokenizer single-threaded (TOKENIZERS_PARALLELISM=false) and every batched method
at the same batch size (ember's default `encode_batch_documents`, 2048), so tokens/s is per core:
  (a) raw    - tokenizers' `encode_batch` alone, ids materialised (the ceiling; the call ember makes)
  (b) megatron - per-document encode + megatron-core `IndexedDatasetBuilder.add_document`, as
               Megatron-LM's tools/preprocess_data.py does, then `finalize`
  (c) datatrove - `DocumentTokenizer.run` on one worker in its fastest documented form: no document
               shuffle, no loss metadata, no final metadata file (the index of document ends is kept)
  (d) ember  - the whole `ember corpus tokenize` Beam pipeline on FnApiRunner from Parquet:
               tokenize, best-fit pack, global shuffle, zstd Arrow shards, manifest
  (d') ember tokenizer - ember's batch encode step alone (framing + uint32 arrays)
Every method runs once untimed first (imports, page cache), then the repeats interleave. The pipeline's
fixed cost (graph, bundles, tokenizer load, manifest) is measured apart on a 25-document input, and
its per-document rate is (d) with that cost taken out.
Fill ratio at L=8192: best-fit-decreasing vs concat-and-chunk over the same document lengths.

    .venv/bin/python bench/bench_tokenize_pack.py [--web-pages 4000] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core each
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from ember.tokenize.config import TokenizeConfig, parse_config  # noqa: E402
from ember.tokenize.packing import best_fit_decreasing, concat_and_chunk  # noqa: E402
from ember.demo.sample_documents import code_documents, web_documents, write_source  # noqa: E402
from ember.tokenize.tokenizers import load_tokenizer  # noqa: E402

EOS = "<|endoftext|>"
BATCH = TokenizeConfig.model_fields["encode_batch_documents"].default  # every batched method uses ember's default
FIXED_COST_DOCUMENTS = 25


def train_tokenizer(texts: list[str], path: Path, vocab_size: int) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def raw_encode(path: Path, texts: list[str]) -> int:
    tokenizer = Tokenizer.from_file(str(path))
    tokens = 0
    for start in range(0, len(texts), BATCH):
        for encoding in tokenizer.encode_batch(texts[start : start + BATCH], add_special_tokens=False):
            tokens += len(encoding.ids) + 1  # + EOS, to count like the others
    return tokens


def megatron_path(path: Path, texts: list[str], out: Path) -> int:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = Tokenizer.from_file(str(path))
    eod = tokenizer.token_to_id(EOS)
    builder = IndexedDatasetBuilder(str(out) + ".bin", dtype=DType.optimal_dtype(tokenizer.get_vocab_size()))
    tokens = 0
    for text in texts:  # preprocess_data.py: Encoder.encode per document, then add_document
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        ids.append(eod)
        builder.add_document(ids, [len(ids)])
        tokens += len(ids)
    builder.finalize(str(out) + ".idx")
    assert np.iinfo(builder.dtype).max >= tokenizer.get_vocab_size() - 1
    return tokens


def datatrove_path(path: Path, texts: list[str], out: Path) -> int:
    from datatrove.data import Document as DTDocument
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    step = DocumentTokenizer(str(out), tokenizer_name_or_path=str(path), eos_token=EOS, seed=0, batch_size=BATCH,
                             shuffle_documents=False, save_loss_metadata=False, save_final_metadata=False)
    step.run((DTDocument(text=t, id=str(i)) for i, t in enumerate(texts)), rank=0, world_size=1)
    return sum((out / f).stat().st_size for f in os.listdir(out) if f.endswith(".ds")) // step.token_size


def ember_tokenizer(config, texts: list[str]) -> int:
    tokenizer = load_tokenizer(config)
    return sum(
        sum(len(t) for t in tokenizer.encode_batch(texts[start : start + BATCH]).tokens)
        for start in range(0, len(texts), BATCH)
    )


def ember_pipeline(settings: dict, out: Path) -> int:
    """`ember corpus tokenize` minus the CLI: `run` loads the tokenizer, checks the input, runs the graph."""
    from ember.pipelines.tokenize_pipeline import run

    manifest = run(parse_config({**settings, "output_dir": str(out)}), overwrite=True)
    return sum(s.tokens for s in manifest.sources.values())


def timed(fn) -> tuple[float, float, int]:
    """CPU seconds of this process (all its threads) and wall seconds: per-core rates use CPU time,
    which a busy shared machine distorts far less than wall time."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, tokens


def fill_report(tokenizer_config, sources: dict[str, list[str]], seq_len: int) -> None:
    tokenizer = load_tokenizer(tokenizer_config)
    print(f"\n## Fill ratio at L={seq_len} (packing per source, one window per source)")
    print(f"{'source':8} {'docs':>6} {'tokens':>10} {'> L':>5} | {'strategy':14} {'seqs':>6} {'fill':>8} {'padding':>9} {'split':>6} {'dropped':>7}")
    totals = {"best_fit": [0, 0, 0], "concat_chunk": [0, 0, 0]}
    for name, texts in sources.items():
        lengths = [len(t) for s in range(0, len(texts), BATCH) for t in tokenizer.encode_batch(texts[s : s + BATCH]).tokens]
        longer = sum(1 for n in lengths if n > seq_len)
        for strategy, fn in (("best_fit", best_fit_decreasing), ("concat_chunk", concat_and_chunk)):
            packing = fn(lengths, seq_len)
            totals[strategy][0] += packing.tokens
            totals[strategy][1] += len(packing.bins)
            totals[strategy][2] += packing.split_documents
            print(
                f"{name:8} {len(lengths):6} {sum(lengths):10} {longer:5} | {strategy:14} {len(packing.bins):6} "
                f"{packing.fill_ratio:8.4%} {packing.padding_tokens:9} {packing.split_documents:6} {0:7}"
            )
    for strategy, (tokens, bins, split) in totals.items():
        print(f"{'all':8} {'':6} {tokens:10} {'':5} | {strategy:14} {bins:6} {tokens / (bins * seq_len):8.4%} {'':9} {split:6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--web-pages", type=int, default=4000)
    parser.add_argument("--code-files", type=int, default=None, help="default: every stdlib source file")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from loguru import logger

    logger.remove()  # datatrove logs every step at INFO

    work = Path(tempfile.mkdtemp(prefix="ember-bench-tokenize-"))
    try:
        code, web = code_documents(args.code_files), web_documents(args.web_pages, seed=0)
        texts = [d.text for d in code] + [d.text for d in web]
        chars = sum(map(len, texts))
        print(f"corpus: {len(code)} code files + {len(web)} web pages, {chars / 1e6:.1f} M characters")
        start = time.perf_counter()
        path = train_tokenizer(texts, work / "tokenizer.json", args.vocab)
        print(f"tokenizer: byte-level BPE, vocab {args.vocab}, trained in {time.perf_counter() - start:.1f}s")
        tokenizer_settings = {"kind": "huggingface", "path": str(path), "eos_token": EOS}
        fill_report(parse_config({"output_dir": "x", "tokenizer": tokenizer_settings, "sources": [{"name": "x", "path": "x"}]}).tokenizer,
                    {"code": [d.text for d in code], "web": [d.text for d in web]}, args.seq_len)

        settings = {
            "output_dir": "unused",
            "seq_len": args.seq_len,
            "tokenizer": tokenizer_settings,
            "sources": [
                {"name": name, "path": str(work / "in" / name / "*.parquet"), "weight": 0.5} for name in ("code", "web")
            ],
        }
        tiny_settings = {**settings, "sources": [
            {"name": name, "path": str(work / "tiny" / name / "*.parquet"), "weight": 0.5} for name in ("code", "web")
        ]}
        for name, documents in (("code", code), ("web", web)):
            write_source(work / "in" / name / "part-0.parquet", documents)
            write_source(work / "tiny" / name / "part-0.parquet", documents[: FIXED_COST_DOCUMENTS // 2 + 1])
        tokenizer_config = parse_config(settings).tokenizer
        runs = {
            "(a) raw encode_batch": lambda: raw_encode(path, texts),
            "(b) megatron per-doc + IndexedDatasetBuilder": lambda: megatron_path(path, texts, work / "megatron"),
            "(c) datatrove DocumentTokenizer": lambda: datatrove_path(path, texts, _fresh(work / "datatrove")),
            "(d) ember pipeline (FnApiRunner)": lambda: ember_pipeline(settings, work / "ember"),
            "(d') ember tokenizer step": lambda: ember_tokenizer(tokenizer_config, texts),
            "fixed": lambda: ember_pipeline(tiny_settings, work / "ember-tiny"),
        }
        for fn in runs.values():
            fn()  # warm-up, untimed: imports, the page cache, Beam's first-run set-up
        cpus: dict[str, list[float]] = {name: [] for name in runs}
        walls: dict[str, list[float]] = {name: [] for name in runs}
        counts: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, fn in runs.items():  # interleaved, so machine noise hits every method alike
                cpu, wall, tokens = timed(fn)
                cpus[name].append(cpu)
                walls[name].append(wall)
                counts[name] = tokens
        report(cpus, walls, counts, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(cpus: dict[str, list[float]], walls: dict[str, list[float]], counts: dict[str, int], repeats: int) -> None:
    rate = {name: statistics.median(counts[name] / c for c in cpu) for name, cpu in cpus.items()}
    fixed = statistics.median(cpus.pop("fixed"))
    ceiling = rate["(a) raw encode_batch"]
    print(f"\n## Tokens per CPU-second = tokens/s per core (median of {repeats}; single-threaded tokenizers, batches of {BATCH})")
    print(f"{'method':48} {'tokens':>10} {'median':>10} {'min':>10} {'max':>10} {'vs (a)':>7} {'wall tok/s':>11}")
    for name, cpu in cpus.items():
        rates = [counts[name] / c for c in cpu]
        print(
            f"{name:48} {counts[name]:10} {rate[name]:10,.0f} {min(rates):10,.0f} {max(rates):10,.0f} "
            f"{rate[name] / ceiling:7.1%} {statistics.median(counts[name] / w for w in walls[name]):11,.0f}"
        )
    name = "(d) ember pipeline (FnApiRunner)"
    ember = rate[name]
    for other in ("(a) raw encode_batch", "(b) megatron per-doc + IndexedDatasetBuilder", "(c) datatrove DocumentTokenizer"):
        print(f"ember pipeline / {other[:3]}: {ember / rate[other]:.2f}x")
    marginal = counts[name] / (statistics.median(cpus[name]) - fixed)
    print(f"ember pipeline fixed cost: {fixed:.2f} CPU-s ({FIXED_COST_DOCUMENTS} documents: graph, bundles, tokenizer load, "
          f"manifest); per-document rate without it: {marginal:,.0f} tokens/s per core = {marginal / ceiling:.1%} of (a), "
          f"{marginal / rate['(c) datatrove DocumentTokenizer']:.2f}x (c)")


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


if __name__ == "__main__":
    main()
