"""`ember corpus ...` (tokenize, verify, inspect) and `ember export ...` over shard sets."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ember.schemas import SchemaValidationError

corpus_app = typer.Typer(help="Corpus builds and the shard sets they produce.", no_args_is_help=True)
export_app = typer.Typer(help="Export shard sets to other trainers' formats.", no_args_is_help=True)
console = Console()


@corpus_app.command(
    "tokenize", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def tokenize(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="YAML config (see ember/tokenize/examples/tokenize.yaml)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous build in output_dir."),
) -> None:
    """Tokenize deduplicated Document Parquet, best-fit pack, write shuffled Arrow shards + manifest.

    Any further arguments go to Beam (default --runner=FnApiRunner), e.g. --direct_num_workers=2.
    """
    from ember.pipelines.tokenize_pipeline import run
    from ember.tokenize.config import ConfigError, load_config
    from ember.tokenize.tokenizers import TokenizerLoadError

    try:
        settings = load_config(config)
        manifest = run(settings, ctx.args, overwrite=overwrite)
    except (ConfigError, TokenizerLoadError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
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


@corpus_app.command("verify")
def verify(directory: str = typer.Argument(..., help="Shard-set directory holding manifest.json.")) -> None:
    """Check a shard set against its manifest: files present, sizes, sha256, row counts."""
    from ember.tokenize.shardset import verify_shard_set

    try:
        problems = verify_shard_set(directory)
    except (FileNotFoundError, SchemaValidationError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    for problem in problems:
        console.print(f"[red]FAIL[/red] {problem}")
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]OK[/green] {directory}: every shard matches its manifest")


@corpus_app.command("inspect")
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
        console.print(f"[red]{shard}: {exc}[/red]")
        raise typer.Exit(2)
    console.print(f"shard {shard} row {row} token {token}: id {record['tokens'][token]}, source {record['source']}")
    if found is None:
        console.print(f"padding (the row's documents end at token {record['cu_seqlens'][-1]})")
        return
    segment, index = found
    console.print(
        f"document {segment['document_id']} token {index} "
        f"(this row holds its tokens [{segment['doc_token_start']}, {segment['doc_token_end']}))"
    )


@export_app.command("megatron")
def export_megatron(
    shards_dir: Path = typer.Argument(..., help="Finished shard-set directory (manifest.json present)."),
    out_prefix: Path = typer.Argument(..., help="Output prefix: writes OUT_PREFIX.bin and OUT_PREFIX.idx."),
) -> None:
    """Write Megatron .bin/.idx, one sequence per packed bin, readable by megatron-core's IndexedDataset."""
    from ember.tokenize.megatron_export import ExportError
    from ember.tokenize.megatron_export import export_megatron as export

    try:
        result = export(shards_dir, out_prefix)
    except (FileNotFoundError, SchemaValidationError, ExportError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    console.print(f"[green]OK[/green] {result.sequences} sequences, {result.tokens} tokens -> {result.bin_path}, {result.idx_path}")
