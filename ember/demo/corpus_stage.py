"""The corpus stage of `ember demo`: raw code + web input to a verified shard set in one build.

The input is the fault-laden sample (malformed lines, invalid UTF-8, near duplicates, secrets) plus
real text found on the machine: standard-library source files as code and Python documentation
prose cut into pages as web. One `ember corpus build` with a `tokenize:` section reads, filters,
redacts, deduplicates, then tokenizes with cl100k_base and best-fit packs the kept documents.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from ember.pipelines.corpus.config import parse_config
from ember.pipelines.jobs.logs import job_logs
from ember.demo.sample_corpus import write_sample_corpus
from ember.demo.tokenize_stage import demo_pack_settings, shard_rows
from ember.demo.sample_documents import code_documents, web_documents

# In-process FnApiRunner: the demo's input is small, so worker processes would only add start-up time.
DEMO_BEAM_ARGS = ["--runner=FnApiRunner"]
STDLIB_FILES = 120
PAGES = 400


def write_real_sources(directory: Path) -> list[dict]:
    """Standard-library code and documentation pages as two more sources of the build."""
    code = code_documents(max_files=STDLIB_FILES, max_chars=60_000)
    pages = web_documents(PAGES, docstring_files=60)
    tables = {
        "stdlib": pa.table({"content": [d.text for d in code], "path": [d.metadata["path"] for d in code]}),
        "pages": pa.table({"text": [d.text for d in pages], "url": [d.metadata["url"] for d in pages]}),
    }
    for name, table in tables.items():
        (directory / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(table, directory / name / "part-0.parquet")
    return [
        {"name": "stdlib", "kind": "code", "inputs": [str(directory / "stdlib" / "*.parquet")], "format": "parquet",
         "fields": {"text": "content", "metadata": {"path": "path"}}, "weight": 0.5},
        {"name": "pages", "kind": "web", "inputs": [str(directory / "pages" / "*.parquet")], "format": "parquet",
         "fields": {"text": "text", "metadata": {"url": "url"}}, "weight": 0.5},
    ]


def run(console: Console, workdir: Path) -> tuple[list[tuple[str, str]], Path]:
    """Build documents and shards; returns the summary rows and the shard directory."""
    sample = write_sample_corpus(workdir / "corpus-input")
    output = workdir / "corpus"
    settings = sample.config(str(output))
    settings["sources"] += write_real_sources(workdir / "corpus-input")
    settings["tokenize"] = demo_pack_settings()
    config = parse_config(settings, "demo corpus config")
    console.print(f"corpus build: {len(config.sources)} sources -> {output}")
    with job_logs() as logs:  # Beam's own logging (and its import-time warnings) to a file, as `ember corpus build`
        console.print(f"log: {logs.write_to(workdir / 'corpus.log')}", highlight=False, soft_wrap=True)
        from ember.pipelines.corpus.build import build_corpus

        outcome = build_corpus(config, DEMO_BEAM_ARGS, console)
    totals = outcome.stats["totals"]
    dedup = outcome.stats["dedup"]
    rows = [
        ("corpus documents in", f"{totals['docs_in']:,}"),
        ("corpus documents kept", f"{totals['kept']:,}"),
        *[(f"corpus rejected {reason}", f"{n:,}") for reason, n in totals["rejected_by_reason"].items()],
        ("corpus exact duplicates removed", f"{dedup['exact_dedup']['removed']:,}"),
        ("corpus near duplicates removed", f"{dedup['near_dedup']['removed']:,}"),
        ("corpus redactions", ", ".join(f"{k}={v}" for k, v in sorted(totals["redactions"].items())) or "none"),
        ("corpus accounted (in = kept + rejected)", "yes" if totals["balanced"] else "NO"),
        ("corpus report", outcome.report),
    ]
    shards = Path(config.shards_directory)
    assert outcome.shards is not None
    return rows + shard_rows(outcome.shards, shards), shards
