"""One corpus build end to end: config, runner options, the Beam job, then report and summary.

Shared by the `ember corpus build` command, the Dataflow flex-template entry point and the demo.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions
from rich.console import Console
from rich.table import Table

from ember.pipelines import corpus_pipeline
from ember.pipelines.corpus_config import ConfigError, CorpusConfig, check_inputs
from ember.pipelines.corpus_report import read_stats, summary_rows, write_report
from ember.pipelines.progress import watch
from ember.pipelines.runners import dataflow_problems, runner_name, runs_locally, with_defaults


class BuildFailed(RuntimeError):
    """The Beam job did not finish in state DONE."""


@dataclass(frozen=True)
class BuildOutcome:
    state: str
    beam_args: list[str]
    stats: dict[str, Any]
    report: str


def prepare_options(beam_args: list[str]) -> tuple[list[str], PipelineOptions]:
    """Defaults applied, and a Dataflow submit checked before anything is staged."""
    args = with_defaults(beam_args)
    options = PipelineOptions(args)
    if runner_name(options) == "DataflowRunner":
        problems = dataflow_problems(options)
        if problems:
            raise ConfigError("Dataflow options are unusable:\n  " + "\n  ".join(problems))
    return args, options


def summary_table(stats: dict[str, Any]) -> Table:
    table = Table(title="corpus build summary")
    table.add_column("", no_wrap=True)
    table.add_column("", justify="right")
    for label, value in summary_rows(stats):
        table.add_row(label, value)
    return table


def build_corpus(config: CorpusConfig, beam_args: list[str], console: Console | None = None) -> BuildOutcome:
    """Run the build to completion; with a console, local runs show live progress and a summary."""
    args, options = prepare_options(beam_args)
    check_inputs(config)
    with tempfile.TemporaryDirectory(prefix="ember-progress-") as progress_dir:
        show = console is not None and runs_locally(options)
        outcome: dict[str, Any] = {}

        def job() -> None:
            try:
                outcome["state"] = corpus_pipeline.run(config, options, progress_dir if show else None)
            except BaseException as exc:  # re-raised on the calling thread below
                outcome["error"] = exc
            finally:
                done.set()

        done = threading.Event()
        worker = threading.Thread(target=job, name="corpus-build", daemon=True)
        worker.start()
        if show:
            watch(progress_dir, done, console)
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    if outcome["state"] != "DONE":
        raise BuildFailed(f"the Beam job ended in state {outcome['state']}")
    directory = config.output.directory
    report = write_report(directory)
    stats = read_stats(directory)
    if console is not None:
        console.print(summary_table(stats))
        console.print(f"report: {report}")
    return BuildOutcome(outcome["state"], args, stats, report)
