"""Web input throughput: WARC -> text documents/s, and language ID documents/s, ember against anchors.

One generated .warc.gz of --pages HTML responses (nav, sidebar, scripts and styles around an article
of 6-14 paragraphs in one of six languages, ~46 kB of HTML each; one in ten responses is a PDF).
All paths read the same file and extract with resiliparse (main_content=True); the paths take turns
within each repeat:

  raw         warcio + resiliparse in this process, no time limit: the ceiling
  datatrove   warcio + datatrove's BaseExtractor/ExtractorSandbox (its per-document time limit: a child
              process fed decoded HTML) over the same resiliparse call; datatrove's WarcReader itself
              needs cchardet and python-magic, which are not installed, so records are read as in `raw`
  ember       ember's read path for `format: warc` (corpus_io.read_file: warc_input + html_text's
              time-limited child + document rows)

Language ID on the extracted texts: raw lingua (the same candidate set, whole text) against ember's
`LanguageIdentifier` (first max_chars=2000 characters, the default) and ember reading the whole text.
Medians of --repeats runs; timing is wall clock on a shared machine, so ratios matter more than rates.

    .venv/bin/python bench/bench_web_input.py [--pages 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ember and its tests' helpers

from datatrove.data import Document as DatatroveDocument  # noqa: E402
from datatrove.pipeline.extractors.base import BaseExtractor  # noqa: E402
from lingua import LanguageDetectorBuilder  # noqa: E402
from resiliparse.extract.html2text import extract_plain_text  # noqa: E402
from resiliparse.parse.encoding import bytes_to_str, detect_encoding  # noqa: E402
from warcio.archiveiterator import ArchiveIterator  # noqa: E402

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.pipelines.corpus.config import CorpusSource  # noqa: E402
from ember.pipelines.corpus.formats import read_file  # noqa: E402
from ember.pipelines.quality.language_id import DEFAULT_CANDIDATES, LanguageIdentifier, known_codes  # noqa: E402
from tests.pipelines.web_support import PROSE, Record, warc_bytes  # noqa: E402

HTML_TYPES = ("text/html", "application/xhtml+xml")


def article(rng: random.Random, language: str) -> list[str]:
    words = PROSE[language].split()
    return [" ".join(rng.choices(words, k=rng.randint(40, 120))) + "." for _ in range(rng.randint(6, 14))]


def html_page(rng: random.Random, i: int) -> bytes:
    language = rng.choice(list(PROSE))
    nav = "".join(f'<li><a href="/section/{k}">Section {k}</a></li>' for k in range(30))
    side = "".join(f'<li><a href="/post/{rng.randint(0, 10**6)}">Related post {k}</a></li>' for k in range(15))
    body = "".join(f"<p>{p}</p>" for p in article(rng, language))
    script = "var analytics = {" + ",".join(f'"k{k}": {k}' for k in range(200)) + "};"
    style = "".join(f".c{k} {{ margin: {k}px; color: #{k:06x}; }}\n" for k in range(150))
    return (
        f'<!DOCTYPE html><html lang="{language}"><head><meta charset="utf-8"><title>Page {i}</title>'
        f"<style>{style}</style><script>{script}</script></head><body>"
        f'<header><div class="logo">Example</div><nav><ul>{nav}</ul></nav></header>'
        f'<div class="content"><main><article><h1>Article {i}</h1>{body}</article></main>'
        f'<aside><h3>Related</h3><ul>{side}</ul></aside></div>'
        f"<footer><p>Copyright 2024 Example Corp. All rights reserved.</p><p>Privacy | Terms | Cookies</p></footer>"
        f"</body></html>"
    ).encode()


def write_archive(path: Path, pages: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    records = [
        Record(f"https://site{i % 97}.example.org/doc/{i}.pdf", b"%PDF-1.4 " + bytes(2000), content_type="application/pdf")
        if i % 10 == 9 else Record(f"https://site{i % 97}.example.org/post/{i}", html_page(rng, i))
        for i in range(pages)
    ]
    data = warc_bytes(records, gzip=True)
    path.write_bytes(data)
    return sum(len(r.payload) for r in records)


def html_records(path: Path):
    """(html text) of every HTML response, read with warcio the way datatrove's WarcReader does."""
    with open(path, "rb") as f:
        for record in ArchiveIterator(f):
            if record.rec_type != "response":
                continue
            media = (record.http_headers.get_header("Content-Type") or "").split(";")[0].strip()
            payload = record.content_stream().read()
            if media in HTML_TYPES:
                yield bytes_to_str(payload, detect_encoding(payload) or "utf-8")


def raw_path(path: Path) -> list[str]:
    return [extract_plain_text(html, main_content=True, preserve_formatting=True) for html in html_records(path)]


class ResiliparseExtractor(BaseExtractor):
    """datatrove's extractor base (ExtractorSandbox: a child process, per-document timeout) over resiliparse."""

    name = "resiliparse"

    def __init__(self, timeout: float):
        super().__init__(timeout)

    def extract(self, text: str) -> str:
        return extract_plain_text(text, main_content=True, preserve_formatting=True)


def datatrove_path(path: Path) -> list[str]:
    docs = (DatatroveDocument(text=html, id=str(i)) for i, html in enumerate(html_records(path)))
    return [doc.text for doc in ResiliparseExtractor(timeout=5).run(docs)]


def ember_path(path: Path) -> list[str]:
    source = CorpusSource.model_validate({"name": "cc", "kind": "web", "inputs": [str(path)], "format": "warc"})
    return [row["text"] for row, _ in read_file(str(path), source) if row is not None]


def timed(fns: dict[str, Callable[[], list]], repeats: int) -> dict[str, tuple[float, list]]:
    """Median seconds and last output of each function; the functions take turns within each repeat, so a
    busy spell on the shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    out: dict[str, list] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - started)
    return {name: (statistics.median(times[name]), out[name]) for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=None, help="default: quick 100, full 1500")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.pages = args.pages or profile_default(args.profile, 100, 1500)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "crawl.warc.gz"
        html_bytes = write_archive(path, args.pages)
        print(f"{args.pages} records ({args.pages // 10} PDFs), {html_bytes / 1e6:.1f} MB of payload, "
              f"{path.stat().st_size / 1e6:.1f} MB .warc.gz; median of {args.repeats}")
        ember_path(path)  # start the extraction child (forkserver) once, outside the timing
        results = timed({
            "raw (warcio + resiliparse, no limit)": lambda: raw_path(path),
            "datatrove ExtractorSandbox + resiliparse": lambda: datatrove_path(path),
            "ember read path (format: warc)": lambda: ember_path(path),
        }, args.repeats)
        n_docs = len(results["raw (warcio + resiliparse, no limit)"][1])
        assert all(len(t) == n_docs for _, t in results.values()), {k: len(t) for k, (_, t) in results.items()}
        raw_rate = n_docs / results["raw (warcio + resiliparse, no limit)"][0]
        dt_rate = n_docs / results["datatrove ExtractorSandbox + resiliparse"][0]
        print(f"\nWARC -> text ({n_docs} HTML documents)")
        for name, (seconds, _) in results.items():
            rate = n_docs / seconds
            print(f"  {name:45s} {rate:8.0f} docs/s   {rate / raw_rate:5.2f}x raw   {rate / dt_rate:5.2f}x datatrove")

        texts = results["ember read path (format: warc)"][1]
        lingua = (LanguageDetectorBuilder.from_languages(*(known_codes()[c] for c in DEFAULT_CANDIDATES))
                  .with_preloaded_language_models().build())
        chars = sum(len(t) for t in texts) / len(texts)
        print(f"\nLanguage ID ({len(texts)} documents, mean {chars:,.0f} characters, {len(DEFAULT_CANDIDATES)} candidates)")
        identifiers = {
            "ember (whole text)": LanguageIdentifier(DEFAULT_CANDIDATES, False, 10**9),
            "ember (max_chars 2000, the default)": LanguageIdentifier(DEFAULT_CANDIDATES, False, 2000),
            "ember (max_chars 2000, low_accuracy)": LanguageIdentifier(DEFAULT_CANDIDATES, True, 2000),
        }
        runs = timed({"raw lingua (whole text)": lambda: [lingua.compute_language_confidence_values(t) for t in texts]}
                     | {label: (lambda i=i: [i.identify(t) for t in texts]) for label, i in identifiers.items()}, args.repeats)
        raw_seconds = runs["raw lingua (whole text)"][0]
        for label, (seconds, _) in runs.items():
            print(f"  {label:45s} {len(texts) / seconds:8.0f} docs/s   {raw_seconds / seconds:5.2f}x raw")
        whole = [code for code, _ in runs["ember (whole text)"][1]]
        for label in ("ember (max_chars 2000, the default)", "ember (max_chars 2000, low_accuracy)"):
            same = sum(a == b for a, b in zip(whole, (code for code, _ in runs[label][1]))) / len(texts)
            print(f"  {label}: same language as on the whole text for {same:.1%} of documents")
        default = "ember (max_chars 2000, the default)"
        write_results(args.results, "bench_web_input", args.profile, [
            Figure("WARC -> text docs/s", "docs/s", n_docs / results["ember read path (format: warc)"][0], dt_rate,
                   "datatrove ExtractorSandbox + resiliparse", repeats=args.repeats),
            Figure("language ID docs/s", "docs/s", len(texts) / runs[default][0], len(texts) / raw_seconds,
                   "raw lingua (whole text)", repeats=args.repeats),
        ], pages=args.pages, documents=n_docs)


if __name__ == "__main__":
    main()
