"""One corpus build end to end: config, runner options, the Beam job, then report and summary.

Shared by the `ember corpus build` command, the Dataflow flex-template entry point and the demo.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions
from rich.console import Console
from rich.table import Table

from ember.configs import CorpusConfigError
from ember.pipelines import corpus_pipeline
from ember.pipelines.corpus_config import CorpusConfig, check_inputs
from ember.pipelines.corpus_report import read_stats, summary_rows, write_report
from ember.pipelines.corpus_report_html import write_html_report
from ember.pipelines.progress import watch
from ember.pipelines.runners import dataflow_problems, runner_name, runs_locally, with_defaults
from ember.schemas import Manifest
from ember.tokenize.config import ShardSource, TokenizeConfig


class BuildFailed(RuntimeError):
    """The Beam job did not finish in state DONE."""


@dataclass(frozen=True)
class BuildOutcome:
    state: str
    beam_args: list[str]
    stats: dict[str, Any]
    report: str
    shards: Manifest | None = None


def prepare_options(beam_args: list[str]) -> tuple[list[str], PipelineOptions]:
    """Defaults applied, and a Dataflow submit checked before anything is staged."""
    args = with_defaults(beam_args)
    options = PipelineOptions(args)
    if runner_name(options) == "DataflowRunner":
        problems = dataflow_problems(options)
        if problems:
            raise CorpusConfigError("Dataflow options are unusable:\n  " + "\n  ".join(problems))
    return args, options


def summary_table(stats: dict[str, Any]) -> Table:
    table = Table(title="corpus build summary")
    table.add_column("", no_wrap=True)
    table.add_column("", justify="right")
    for label, value in summary_rows(stats):
        table.add_row(label, value)
    return table


def shards_config(config: CorpusConfig) -> TokenizeConfig:
    """The tokenize stage's config: the kept documents of each source that kept any, at its weight."""
    assert config.tokenize is not None and config.shards_directory is not None
    documents = f"{config.output.directory.rstrip('/')}/documents"
    sources = [
        ShardSource(name=s.name, path=f"{documents}/{s.name}/*.parquet", weight=s.weight)
        for s in config.sources
        if FileSystems.match([f"{documents}/{s.name}/*.parquet"], limits=[1])[0].metadata_list
    ]
    if not sources:
        raise CorpusConfigError(f"tokenize: the build kept no document in any source (see {config.output.directory}/stats.json)")
    settings = config.tokenize.model_dump(exclude={"output_dir"})
    return TokenizeConfig(**settings, output_dir=config.shards_directory, sources=sources)


def build_corpus(config: CorpusConfig, beam_args: list[str], console: Console | None = None,
                 config_path: str | None = None) -> BuildOutcome:
    """Run the build to completion; with a console, local runs show live progress and a summary.

    `config_path` (the YAML file the config came from) only titles report.html.
    """
    args, options = prepare_options(beam_args)
    check_inputs(config)
    tokenizer = None
    if config.tokenize is not None:
        from ember.tokenize.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(config.tokenize.tokenizer)  # one that does not load fails before the long part
    with tempfile.TemporaryDirectory(prefix="ember-progress-") as progress_dir:
        # The job runs on this (main) thread: portable runners' job servers install signal handlers,
        # which Python allows only there. The live progress table renders from a helper thread.
        done = threading.Event()
        watcher = None
        if console is not None and runs_locally(options):
            watcher = threading.Thread(target=watch, args=(progress_dir, done, console), name="corpus-progress", daemon=True)
            watcher.start()
        try:
            state = corpus_pipeline.run(config, options, progress_dir if watcher else None)
        finally:
            done.set()
            if watcher:
                watcher.join()
    if state != "DONE":
        raise BuildFailed(f"the Beam job ended in state {state}")
    directory = config.output.directory
    report = write_report(directory)
    stats = read_stats(directory)
    if console is not None:
        console.print(summary_table(stats))
        console.print(f"report: {report}")
    shards = None
    if config.tokenize is not None:
        from ember.pipelines.tokenize_pipeline import run as tokenize

        if console is not None:
            console.print(f"tokenize + pack -> {config.shards_directory}")
        shards = tokenize(shards_config(config), args, overwrite=True, tokenizer=tokenizer)
        if console is not None:
            console.print(shards_table(shards))
    # After tokenize, so the page's token-length histogram reads the shard set the build just made.
    html_report = write_html_report(directory, config_path, config.shards_directory if shards else None)
    if console is not None:
        console.print(f"report with charts: {html_report}")
    return BuildOutcome(state, args, stats, report, shards)


def shards_table(manifest: Manifest) -> Table:
    table = Table("source", "documents", "tokens", "sequences", "fill", "split", title="shard set")
    for name, source in manifest.sources.items():
        fill = source.tokens / max(1, source.sequences * manifest.seq_len)
        table.add_row(name, f"{source.documents:,}", f"{source.tokens:,}", f"{source.sequences:,}", f"{fill:.2%}",
                      f"{source.split_documents:,}")
    return table
