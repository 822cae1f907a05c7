"""Code mid-training data (issue 32): the cost of repository documents + FIM, packing fill with repository
documents, and the quality classifier's throughput.

Input: the Python standard library's files (stdlib packages as repositories: `email/`, `json/`, ...; top-level
modules as one-file repositories), tokenizer cl100k_base (tiktoken, shipped offline; it has FIM tokens).
  1. tokens/s of the whole `ember corpus tokenize` pipeline (tokenize + pack + shuffle + shards) on the same
     Parquet, with `repositories` (dependency order) and `fim` (rate 0.5, file level) on against off; runs
     interleave, median of the repeats, CPU time of the process (per core), ratio printed.
  2. packing fill (best-fit-decreasing) of repository documents against file documents at L=8192 and 16384.
  3. fastText classifier documents/s on one core (a model trained here, thread=1), over the same files.

    .venv/bin/python bench/bench_code_data.py [--files 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.demo.sample_documents import code_files, write_source  # noqa: E402
from ember.pipelines.code.repo_tokens import repository_tokens  # noqa: E402
from ember.pipelines.code.repos import RepoFile  # noqa: E402
from ember.schemas.documents import Document  # noqa: E402
from ember.tokenize.config import RepositorySettings, TokenizerConfig, parse_config  # noqa: E402
from ember.tokenize.packing import best_fit_decreasing  # noqa: E402
from ember.tokenize.tokenizers import load_tokenizer  # noqa: E402

TOKENIZER = {"name": "cl100k_base"}
FIM = {"rate": 0.5, "spm_rate": 0.5, "level": "file", "prefix_token": "<|fim_prefix|>",
       "middle_token": "<|fim_middle|>", "suffix_token": "<|fim_suffix|>"}


def documents(limit: int) -> list[Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in code_files()[:limit]:
        relative = path.relative_to(stdlib)
        repo = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        docs.append(Document(source="code", kind="code", text=path.read_text(encoding="utf-8", errors="replace"),
                             metadata={"repo": f"cpython/{repo}", "path": relative.as_posix(), "language": "python"}))
    return docs


def pipeline_run(parquet: Path, out: Path, on: bool) -> tuple[float, int]:
    from ember.pipelines.tokenize_pipeline import run

    settings = {"tokenizer": TOKENIZER, "seq_len": 8192, "output_dir": str(out),
                "sources": [{"name": "code", "path": str(parquet)}]}
    if on:
        settings |= {"fim": FIM, "repositories": {"order": "dependency"}}
    cpu = time.process_time()
    manifest = run(parse_config(settings), overwrite=True)
    return time.process_time() - cpu, sum(s.tokens for s in manifest.sources.values())


def fill(docs: list[Document]) -> None:
    tokenizer = load_tokenizer(TokenizerConfig(**TOKENIZER))
    files = [len(t) for t in tokenizer.encode_batch([d.text for d in docs]).tokens]
    by_repo: dict[str, list[RepoFile]] = {}
    for d in docs:
        by_repo.setdefault(d.metadata["repo"], []).append(RepoFile(d.id, d.metadata["path"], d.text))
    repos = [len(repository_tokens("code", r, f, RepositorySettings(), tokenizer).tokens) for r, f in by_repo.items()]
    print(f"\n## Packing fill, best-fit-decreasing ({len(files)} files in {len(repos)} repositories)")
    print("| L | file documents | repository documents | repositories split (longer than L) |")
    print("|---|---|---|---|")
    for seq_len in (8192, 16384):
        split = sum(n > seq_len for n in repos)
        print(f"| {seq_len} | {best_fit_decreasing(files, seq_len).fill_ratio:.2%} | "
              f"{best_fit_decreasing(repos, seq_len).fill_ratio:.2%} | {split} of {len(repos)} |")


def classifier(docs: list[Document], work: Path) -> float:
    import fasttext

    from ember.pipelines.quality.classifier import FastTextScorer

    rng = random.Random(0)
    lines = []
    for d in docs[:200]:
        words = d.text.split()[:200]
        lines.append("__label__hq " + " ".join(words))
        lines.append("__label__lq " + " ".join(rng.sample(words, len(words))))  # shuffled: not code any more
    (work / "train.txt").write_text("\n".join(lines) + "\n")
    model = fasttext.train_supervised(str(work / "train.txt"), epoch=5, thread=1, seed=0, verbose=0, wordNgrams=2)
    model.save_model(str(work / "quality.bin"))
    scorer = FastTextScorer(str(work / "quality.bin"), "__label__hq", 100_000)
    texts = [d.text for d in docs]
    scorer.score(texts[0])
    cpu = time.process_time()
    for text in texts:
        scorer.score(text)
    seconds = time.process_time() - cpu
    chars = sum(min(len(t), 100_000) for t in texts)
    print(f"\n## Quality classifier (fastText, thread=1): {len(texts) / seconds:,.0f} documents/s per core "
          f"({chars / seconds / 1e6:.1f} M chars/s; documents of {chars / len(texts):,.0f} characters on average)")
    return len(texts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=None, help="default: quick 80, full 400")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.files = args.files or profile_default(args.profile, 80, 400)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    docs = documents(args.files)
    with tempfile.TemporaryDirectory(prefix="bench-code-") as tmp:
        work = Path(tmp)
        parquet = write_source(work / "code.parquet", docs)
        pipeline_run(parquet, work / "warm", False)  # imports, page cache, tokenizer
        results: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, int] = {}
        for _ in range(args.repeats):
            for on in (False, True):
                seconds, tokens[on] = pipeline_run(parquet, work / f"out-{on}", on)
                results[on].append(tokens[on] / seconds)
        off, on = (statistics.median(results[k]) for k in (False, True))
        print(f"## Tokenize + pack, {len(docs)} files, L=8192, cl100k_base (median of {args.repeats}, CPU time)")
        print("| run | tokens | tokens/s per core |")
        print("|---|---|---|")
        print(f"| file documents, no FIM | {tokens[False]:,} | {off:,.0f} |")
        print(f"| repository documents (dependency order) + FIM 0.5 | {tokens[True]:,} | {on:,.0f} |")
        print(f"ratio on/off: {on / off:.2f}x (goal >= 0.95x)")
        fill(docs)
        docs_s = classifier(docs, work)
    write_results(args.results, "bench_code_data", args.profile, [
        Figure("tokens/s per core, repository documents + FIM", "tokens/CPU-s", on, off, "file documents, no FIM",
               repeats=args.repeats, target=0.95),
        Figure("fastText classifier documents/s per core", "docs/CPU-s", docs_s),
    ], files=len(docs), tokens={"off": tokens[False], "on": tokens[True]})


if __name__ == "__main__":
    main()
