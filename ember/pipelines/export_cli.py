"""`ember export ...`: finished shard sets in other trainers' formats."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Export shard sets to other trainers' formats.", no_args_is_help=True)
console = Console()


@app.command("megatron")
def export_megatron(
    shards_dir: Path = typer.Argument(..., help="Finished shard-set directory (manifest.json present)."),
    out_prefix: Path = typer.Argument(..., help="Output prefix: writes OUT_PREFIX.bin and OUT_PREFIX.idx."),
) -> None:
    """Write Megatron .bin/.idx, one sequence per packed bin, readable by megatron-core's IndexedDataset."""
    from ember.schemas import SchemaValidationError
    from ember.tokenize.megatron_export import ExportError
    from ember.tokenize.megatron_export import export_megatron as export

    try:
        result = export(shards_dir, out_prefix)
    except (FileNotFoundError, SchemaValidationError, ExportError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    console.print(f"[green]OK[/green] {result.sequences} sequences, {result.tokens} tokens -> {result.bin_path}, {result.idx_path}")
