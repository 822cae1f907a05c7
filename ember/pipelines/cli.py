"""`ember corpus ...`: build and report a corpus, tokenize it into a shard set, verify and inspect shards.

`build` and `tokenize` pass every option they do not know to Beam untouched (`--runner=...`).
Exit codes: 0 done, 1 the job or the check failed, 2 the input or the config cannot be used,
130 / 143 stopped by SIGINT / SIGTERM (workers stopped, the previous output left as it was).
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.table import Table

from ember.schemas import SchemaValidationError

BEAM_OPTIONS = {"allow_extra_args": True, "ignore_unknown_options": True}
MIN_FREE_HELP = "Refuse to start unless the output's filesystem has this many MiB free (default: estimated from the inputs)."

app = typer.Typer(help="Corpus builds and the shard sets they produce.", no_args_is_help=True)
console = Console()


def fail(message: object, code: int = 2) -> NoReturn:
    console.print(f"[red]{message}[/red]")
    raise typer.Exit(code)


def stopped(exc: BaseException) -> NoReturn:
    """The one line an interrupted build or tokenize ends with (soft-wrapped: a terminal may fold it, a log keeps it
    whole), and its exit code: 128 + the signal."""
    from rich.text import Text

    console.print(Text(f"interrupted: {exc}", style="red"), soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@app.command("tokenize", context_settings=BEAM_OPTIONS)
def tokenize(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="YAML config (see ember/tokenize/examples/tokenize.yaml)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous build in output_dir."),
    min_free_mb: int | None = typer.Option(None, "--min-free-mb", min=0, help=MIN_FREE_HELP),
) -> None:
    """Tokenize deduplicated Document Parquet, best-fit pack, write shuffled Arrow shards + manifest.

    Any further arguments go to Beam (default --runner=FnApiRunner), e.g. --direct_num_workers=2.
    """
    from ember.configs import TokenizeConfigError
    from ember.pipelines.job_process import Interrupted, stop_on_signals
    from ember.pipelines.output_guard import OutputUnusable
    from ember.pipelines.tokenize_pipeline import run
    from ember.tokenize.config import load_config
    from ember.tokenize.tokenizers import TokenizerLoadError

    try:
        settings = load_config(config)
        min_free = None if min_free_mb is None else min_free_mb * 2**20
        with stop_on_signals():
            manifest = run(settings, ctx.args, overwrite=overwrite, min_free_bytes=min_free)
    except (TokenizeConfigError, TokenizerLoadError, OutputUnusable) as exc:
        fail(exc)
    except Interrupted as exc:
        out = settings.output_dir
        exc.state = exc.state or (f"output_dir {out} holds the previous shard set, unchanged" if out.exists()
                                  else f"output_dir {out} was not created") + "; a rerun starts the tokenize job over"
        stopped(exc)
    table = Table("source", "documents", "tokens", "sequences", "padding", "fill", "split docs", "rejected")
    for name, stats in manifest.sources.items():
        rejected = sum((manifest.model_extra.get("rejected") or {}).get(name, {}).values())
        fill = stats.tokens / (stats.sequences * manifest.seq_len) if stats.sequences else 0.0
        table.add_row(
            name, str(stats.documents), str(stats.tokens), str(stats.sequences), str(stats.padding_tokens),
            f"{fill:.2%}", str(stats.split_documents), str(rejected),
        )
    console.print(table)
    console.print(f"[green]OK[/green] {len(manifest.shards)} shards in {settings.output_dir}")


@app.command("verify")
def verify(directory: str = typer.Argument(..., help="Shard-set directory holding manifest.json.")) -> None:
    """Check a shard set against its manifest: files present, sizes, sha256, row counts."""
    from ember.tokenize.shardset import verify_shard_set

    try:
        problems = verify_shard_set(directory)
    except (FileNotFoundError, SchemaValidationError) as exc:
        fail(exc)
    for problem in problems:
        console.print(f"[red]FAIL[/red] {problem}")
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]OK[/green] {directory}: every shard matches its manifest")


@app.command("inspect")
def inspect(
    locate: tuple[Path, int, int] = typer.Option(
        ..., "--locate", metavar="SHARD ROW TOKEN", help="Map token TOKEN of row ROW of shard file SHARD to its source."
    ),
) -> None:
    """Trace a training token back to its source document and its index in that document's tokens."""
    from ember.tokenize.packing import locate as locate_token
    from ember.tokenize.shards import read_row

    shard, row, token = locate
    try:
        record = read_row(shard, row)
        if not 0 <= token < len(record["tokens"]):
            raise IndexError(f"token {token} is outside the row's {len(record['tokens'])} tokens")
        found = locate_token(record["cu_seqlens"], record["segments"], token)
    except (OSError, IndexError, ValueError) as exc:
        fail(f"{shard}: {exc}")
    console.print(f"shard {shard} row {row} token {token}: id {record['tokens'][token]}, source {record['source']}")
    if found is None:
        console.print(f"padding (the row's documents end at token {record['cu_seqlens'][-1]})")
        return
    segment, index = found
    console.print(
        f"document {segment['document_id']} token {index} "
        f"(this row holds its tokens [{segment['doc_token_start']}, {segment['doc_token_end']}))"
    )


@app.command("build", context_settings=BEAM_OPTIONS)
def build(
    config: Path = typer.Argument(..., help="Corpus build YAML (sources, filters, redaction, dedup, output)."),
    beam_args: list[str] = typer.Argument(
        None,
        help="Beam pipeline options, passed through unchanged. Default: --runner=FnApiRunner "
        "--direct_running_mode=multi_processing --direct_num_workers=<cores>.",
    ),
    min_free_mb: int | None = typer.Option(None, "--min-free-mb", min=0, help=MIN_FREE_HELP),
) -> None:
    """Read, filter, redact and deduplicate code and web corpora into Parquet, with stats.json and a report;
    with a `tokenize:` section, also tokenize and pack the kept documents into a verified shard set.
    A rebuild replaces the previous output whole, only once the new one is complete, and refuses to start
    when the output holds files ember did not write. Ctrl-C (SIGINT) or SIGTERM stops it within seconds
    (exit 130 / 143); a rerun of the same config skips the phases that are complete."""
    from ember.configs import CorpusConfigError, TokenizeConfigError
    from ember.pipelines.corpus_build import BuildFailed, build_corpus
    from ember.pipelines.corpus_config import load_config
    from ember.pipelines.job_process import Interrupted, stop_on_signals
    from ember.pipelines.output_guard import OutputUnusable
    from ember.tokenize.tokenizers import TokenizerLoadError

    min_free = None if min_free_mb is None else min_free_mb * 2**20
    try:
        with stop_on_signals():
            build_corpus(load_config(str(config)), list(beam_args or []), console, min_free_bytes=min_free)
    except (CorpusConfigError, TokenizeConfigError, TokenizerLoadError, OutputUnusable) as exc:
        fail(exc)
    except BuildFailed as exc:
        fail(exc, 1)
    except Interrupted as exc:
        stopped(exc)


@app.command("report")
def report(directory: str = typer.Argument(..., help="Output directory of a finished build (local or gs://...).")) -> None:
    """(Re)write report.md from a build's outputs, e.g. after a Dataflow job, and print the summary."""
    from ember.pipelines.corpus_build import summary_table
    from ember.pipelines.corpus_report import read_stats, write_report

    try:
        path = write_report(directory)
    except FileNotFoundError as exc:
        fail(f"{directory} holds no finished build: {exc}")
    console.print(summary_table(read_stats(directory)))
    console.print(f"report: {path}")
