"""`ember export ...`: finished shard sets in other trainers' formats."""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path

import typer
from rich.markup import escape

from ember import terminal

app = typer.Typer(help="Export shard sets to other trainers' formats.", no_args_is_help=True)
console = terminal.console()


SHOWN = 10


@app.command("megatron")
def export_megatron(
    shards_dir: str = typer.Argument(..., help="Finished shard-set directory (manifest.json present): path, gs:// or s3://."),
    out_prefix: str = typer.Argument(
        ..., help="Output prefix: writes OUT_PREFIX.bin and OUT_PREFIX.idx (path, gs:// or s3://; .idx last)."
    ),
    documents: bool = typer.Option(
        False, "--documents", help="One Megatron document per source document, padding dropped (as preprocess_data.py writes)."
    ),
    blend: bool = typer.Option(
        False, "--blend", help="One .bin/.idx per source (OUT_PREFIX.<source>) and the blend for Megatron's --data-path "
        "(OUT_PREFIX.data-path.txt) and --per-split-data-args-path (OUT_PREFIX.per-split.json); local output only.",
    ),
    strict: bool = typer.Option(False, "--strict", help="Exit 3 when a document had to be left out (the output is still written)."),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also show third-party Python warnings and logs (megatron, Transformer Engine, Beam) on stderr."
    ),
) -> None:
    """Write Megatron .bin/.idx readable by megatron-core's IndexedDataset: one sequence per packed row, or
    with --documents one per source document, rebuilt from the rows' provenance in manifest order."""
    from ember.pipelines.jobs.logs import quiet_third_party

    with nullcontext() if verbose else quiet_third_party():
        from ember import storage
        from ember.schemas import SchemaValidationError
        from ember.tokenize.megatron_export import ExportError
        from ember.tokenize.megatron_export import export_megatron as export
        from ember.tokenize.remote_sets import RemoteSetError, local_shard_set

        if blend:
            _export_blend(shards_dir, out_prefix, documents)
            return
        try:
            if storage.is_url(out_prefix):
                storage.preflight(out_prefix.rsplit("/", 1)[0], write=True)
            local_set = local_shard_set(shards_dir)
            with tempfile.TemporaryDirectory(prefix="ember-export-") as staging:
                local_prefix = Path(staging) / "out" if storage.is_url(out_prefix) else Path(out_prefix)
                result = export(local_set, local_prefix, documents=documents)
                written = [str(result.bin_path), str(result.idx_path)]
                if storage.is_url(out_prefix):  # the index last: a reader that finds it finds the whole .bin
                    written = [
                        storage.upload(result.bin_path, f"{out_prefix}.bin"), storage.upload(result.idx_path, f"{out_prefix}.idx")
                    ]
        except (FileNotFoundError, SchemaValidationError, ExportError, storage.StorageError, RemoteSetError) as exc:
            console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)  # one line, paths whole
            raise typer.Exit(2)
    what = "documents" if documents else "sequences"
    console.print(f"[green]OK[/green] {result.sequences} {what}, {result.tokens} tokens -> {written[0]}, {written[1]}", soft_wrap=True)
    if result.incomplete:
        shown = "; ".join(f"{key} ({why})" for key, why in list(result.incomplete.items())[:SHOWN])
        more = f"; and {len(result.incomplete) - SHOWN} more" if len(result.incomplete) > SHOWN else ""
        console.print(
            f"[yellow]{len(result.incomplete)} documents left out, their pieces do not join up in the shard rows:[/yellow] "
            f"{shown}{more}"
        )
        if strict:
            raise typer.Exit(3)


def _export_blend(shards_dir: str, out_prefix: str, documents: bool) -> None:
    from ember import storage
    from ember.schemas import SchemaValidationError
    from ember.tokenize.megatron_blend import export_blend
    from ember.tokenize.megatron_export import ExportError
    from ember.tokenize.remote_sets import RemoteSetError, local_shard_set

    if documents or storage.is_url(out_prefix):
        why = "--documents" if documents else f"a {out_prefix.split(':', 1)[0]}:// output"
        console.print(f"[red]--blend writes sequences to a local prefix; it takes no {why}[/red]", soft_wrap=True)
        raise typer.Exit(2)
    try:
        result = export_blend(local_shard_set(shards_dir), Path(out_prefix))
    except (FileNotFoundError, SchemaValidationError, ExportError, storage.StorageError, RemoteSetError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(2)
    for name, prefix in result.prefixes.items():
        console.print(f"[green]OK[/green] {name}: {result.sequences[name]} sequences, weight {result.weights[name]:.4g} -> "
                      f"{prefix}.bin, {prefix}.idx", soft_wrap=True)
    console.print(f"--data-path words: {result.data_path}; --per-split-data-args-path: {result.per_split}", soft_wrap=True)
