"""The corpus-build stage of `ember demo`: a small real mixed code + web input through the real build."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ember.pipelines.corpus_build import build_corpus
from ember.pipelines.corpus_config import parse_config
from ember.pipelines.sample_corpus import write_sample_corpus

# In-process FnApiRunner: the demo's input is tiny, so worker processes would only add start-up time.
DEMO_BEAM_ARGS = ["--runner=FnApiRunner"]


def run(console: Console, workdir: Path) -> tuple[list[tuple[str, str]], Path]:
    """Write the sample (malformed lines, near duplicates, secrets included), build it, and return the
    summary rows plus the folder of deduplicated Parquet (`<folder>/<source>/part-*.parquet`)."""
    sample = write_sample_corpus(workdir / "corpus-input")
    output = workdir / "corpus"
    config = parse_config(sample.config(str(output)), "demo corpus config")
    console.print(f"corpus build: {len(config.sources)} sources -> {output}")
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
    return rows, output / "documents"
