"""`ember corpus ...`: commands over built corpora and shard sets."""

from __future__ import annotations

import typer
from rich.console import Console

from ember.schemas import SchemaValidationError

corpus_app = typer.Typer(help="Corpus builds and the shard sets they produce.", no_args_is_help=True)
console = Console()


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
