"""`ember corpus build CONFIG.yaml [Beam options...]` and `ember corpus report DIR`.

ember/cli.py mounts both under `ember corpus`; `build` takes BUILD_CONTEXT_SETTINGS so Beam's
`--runner=...` style options reach `beam_args` untouched. `app` below is the same pair on its own.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

BUILD_CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True}
console = Console()


def build(
    config: Path = typer.Argument(..., help="Corpus build YAML (sources, filters, redaction, dedup, output)."),
    beam_args: list[str] = typer.Argument(
        None,
        help="Beam pipeline options, passed through unchanged. Default: --runner=FnApiRunner "
        "--direct_running_mode=multi_processing --direct_num_workers=<cores>.",
    ),
) -> None:
    """Read, filter, redact and deduplicate code and web corpora into Parquet, with stats.json and a report;
    with a `tokenize:` section, also tokenize and pack the kept documents into a verified shard set."""
    from ember.pipelines.corpus_build import BuildFailed, build_corpus
    from ember.pipelines.corpus_config import ConfigError, load_config
    from ember.tokenize.config import ConfigError as TokenizeConfigError
    from ember.tokenize.tokenizers import TokenizerLoadError

    try:
        build_corpus(load_config(str(config)), list(beam_args or []), console)
    except (ConfigError, TokenizeConfigError, TokenizerLoadError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    except BuildFailed as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1)


def report(directory: str = typer.Argument(..., help="Output directory of a finished build (local or gs://...).")) -> None:
    """(Re)write report.md from a build's outputs, e.g. after a Dataflow job, and print the summary."""
    from ember.pipelines.corpus_build import summary_table
    from ember.pipelines.corpus_report import read_stats, write_report

    try:
        path = write_report(directory)
    except FileNotFoundError as exc:
        console.print(f"[red]{directory} holds no finished build: {exc}[/red]")
        raise typer.Exit(2)
    console.print(summary_table(read_stats(directory)))
    console.print(f"report: {path}")


app = typer.Typer(help="Corpus builds (the same command `ember corpus build` mounts).", no_args_is_help=True)
app.command("build", context_settings=BUILD_CONTEXT_SETTINGS)(build)
app.command("report")(report)


@app.callback()
def _group() -> None:
    """Keeps `build` a named subcommand, as under `ember corpus`."""
