"""One corpus build end to end: config, runner options, the Beam job, then report and summary.

Shared by the `ember corpus build` command, the Dataflow flex-template entry point and the demo.

A local output is checked before any work (only files of ember's own in it, a writable parent with
room for the new output), built whole in a staging directory next to it - documents, rejects,
clusters, stats, report and a shard set inside it - and swapped in only when complete
(ember/pipelines/jobs/output_guard.py). A shard set outside the output is staged and swapped the same way,
just before the output. A URL output (gs://) must be new or empty: the job never deletes there.

A local build runs in two checkpointed phases (ember/pipelines/corpus/phases.py): a rerun of the same
config skips what is complete and verified. A small input (`runners.SMALL_INPUT_BYTES`) runs both as one
fused Beam job in this process: its fixed cost is paid once; a larger one runs them as two jobs, so an
interrupted build resumes from the last finished phase (`phases=` overrides the choice).
Under `stop_on_signals()` (the CLI) each Beam job runs in a child process that SIGINT/SIGTERM stop whole
(ember/pipelines/jobs/process.py); `Interrupted` leaves here saying what state the output is in.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember import storage
from ember.configs import CorpusConfigError
from ember.pipelines.corpus import phases, pipeline, trees
from ember.pipelines.corpus.config import CorpusConfig, CorpusSource, check_inputs
from ember.pipelines.corpus.incremental import check_indexes
from ember.pipelines.corpus.outputs import require_empty_output
from ember.pipelines.corpus.report import (
    SourceWarning,
    VanishedSource,
    build_warnings,
    read_stats,
    summary_rows,
    vanished_sources,
    write_report,
)
from ember.pipelines.corpus.report_html import write_html_report
from ember.schemas.documents import REPORT_FILE, REPORT_HTML_FILE
from ember.pipelines.jobs.output_guard import (
    MIN_FREE_BYTES, OutputUnusable, check_room, is_local, owned_by_ownership_file, refuse_foreign, staged, up_to_date,
    write_ownership,
)
from ember.pipelines.jobs.process import Interrupted, run_job, signals_deferred
from ember.pipelines.jobs.set_commit import NAMED_TOKENIZER, refuse_unshared_disk
from ember.pipelines.jobs.progress import watch
from ember.pipelines.jobs.runners import (
    BuildFailed, dataflow_problems, is_small, runner_name, runs_locally, with_defaults,
)
from ember.schemas import Manifest, read_manifest
from ember.tokenize.config import ShardSource, TokenizeConfig

if TYPE_CHECKING:
    from ember.tokenize.tokenizers import Tokenizer

# Output bytes per input byte, a generous ceiling: outputs are zstd Parquet, so plain JSONL shrinks;
# compressed inputs (Parquet, gzip, zstd) expand to their text first. A shard set inside the output doubles it.
OUTPUT_PER_INPUT_BYTE = {"jsonl": 1, "parquet": 3, "jsonl.gz": 4, "jsonl.zst": 4, "warc": 4, "html": 1, "files": 1}
Phases = Literal["auto", "fused", "split"]
"""How a local build runs its two phases: one fused Beam job, two jobs (an interruption resumes after
`documents`), or fused exactly when the input is small."""


@dataclass(frozen=True)
class BuildOutcome:
    state: str
    beam_args: list[str]
    stats: dict[str, Any]
    report: str
    shards: Manifest | None = None
    warnings: tuple[SourceWarning, ...] = ()
    phases: dict[str, str] = field(default_factory=dict)  # phase -> "ran" or "skipped" (local builds)
    vanished: tuple[VanishedSource, ...] = ()


def prepare_options(beam_args: list[str], input_bytes: int | None = None) -> tuple[list[str], PipelineOptions]:
    """Defaults applied (in-process for a small `input_bytes`), and a Dataflow submit checked before anything is staged."""
    args = with_defaults(beam_args, input_bytes)
    options = PipelineOptions(args)
    if runner_name(options) == "DataflowRunner":
        problems = dataflow_problems(options)
        if problems:
            raise CorpusConfigError("Dataflow options are unusable:\n  " + "\n  ".join(problems))
    return args, options


def rows_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """(label, value) rows as the two-column table every summary prints."""
    table = Table(title=title, show_header=False)
    table.add_column("", no_wrap=True)
    table.add_column("", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    return table


def summary_table(stats: dict[str, Any]) -> Table:
    return rows_table("corpus build summary", summary_rows(stats))


def shards_config(config: CorpusConfig, output_dir: str | None = None) -> TokenizeConfig:
    """The tokenize stage's config: the kept documents of each source that kept any, at its weight; the shard set goes
    to `output_dir` when given (a local staging directory for a set on an object store), else config's directory."""
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
    return TokenizeConfig(**settings, output_dir=output_dir or config.shards_directory, sources=sources)


def _tokenize_to_url(config: CorpusConfig, final: CorpusConfig, args: list[str], tokenizer: Tokenizer | None,
                     console: Console | None) -> Manifest:
    """A shard set for a gs:// or s3:// directory, committed by the tokenize command's own `write_to_url`."""
    from ember.pipelines.tokenize_pipeline import write_to_url

    settings = shards_config(config)
    return write_to_url(settings, args, tokenizer, _recorded(settings, final), console)


def _input_bytes(source: CorpusSource) -> int:
    """What a source's inputs hold; for a `files` source, the files its walk would read (no .git/, nothing ignored)."""
    if source.format == "files":
        return sum(f.size for pattern in source.inputs for root in trees.directories(pattern)
                   for f in trees.walk(root) if isinstance(f, trees.TreeFile))
    return sum(m.size_in_bytes for pattern in source.inputs for m in FileSystems.match([pattern])[0].metadata_list)


def local_input_bytes(config: CorpusConfig) -> int | None:
    """What the inputs hold when all are local (it picks the runner and the phases); None when any is a URL."""
    if any(storage.is_url(pattern) for source in config.sources for pattern in source.inputs):
        return None
    return sum(_input_bytes(source) for source in config.sources)


def free_space_needed(config: CorpusConfig) -> int:
    """A floor for the new output, estimated from the input sizes (see `OUTPUT_PER_INPUT_BYTE`)."""
    total = sum(_input_bytes(source) * OUTPUT_PER_INPUT_BYTE[source.format] for source in config.sources)
    return MIN_FREE_BYTES + total * (2 if config.tokenize is not None else 1)


def _inside(path: str, directory: Path) -> Path | None:
    """`path` relative to `directory` when it lies inside it."""
    try:
        return Path(os.path.abspath(path)).relative_to(directory)
    except ValueError:
        return None


def _staged_config(config: CorpusConfig, staging: Path, target: Path) -> CorpusConfig:
    """`config` writing into `staging` instead of `target`, a shard set inside the output included."""
    update: dict[str, Any] = {"output": config.output.model_copy(update={"directory": str(staging)})}
    inside = _inside(config.tokenize.output_dir, target) if config.tokenize and config.tokenize.output_dir else None
    if inside is not None:
        update["tokenize"] = config.tokenize.model_copy(update={"output_dir": str(staging / inside)})
    return config.model_copy(update=update)


def _recorded(shards: TokenizeConfig, final: CorpusConfig) -> TokenizeConfig:
    """The shard config as the finished output will have it: the manifest's hash and the rejects name these paths."""
    documents = f"{final.output.directory.rstrip('/')}/documents"
    sources = [s.model_copy(update={"path": f"{documents}/{s.name}/*.parquet"}) for s in shards.sources]
    return shards.model_copy(update={"sources": sources, "output_dir": final.shards_directory if storage.is_url(final.shards_directory)
                                else Path(final.shards_directory)})


def _whole_job(config: CorpusConfig, args: list[str], progress_dir: str | None) -> str:
    """The one-graph build (URL outputs), at module level so it can run in a job process."""
    return pipeline.run(config, PipelineOptions(args), progress_dir)


def _run_job(job: Callable[..., str], job_args: tuple, options, console: Console | None) -> None:
    """`job(*job_args, progress_dir)` to the end, with live progress for local runs."""
    with tempfile.TemporaryDirectory(prefix="ember-progress-") as progress_dir:
        # The job runs on a main thread (here, or a job process's): portable runners' job servers install
        # signal handlers, which Python allows only there. The live progress table renders from a helper thread.
        done = threading.Event()
        watcher = None
        if console is not None and runs_locally(options):
            watcher = threading.Thread(target=watch, args=(progress_dir, done, console), name="corpus-progress", daemon=True)
            watcher.start()
        try:
            state = run_job(job, *job_args, progress_dir if watcher else None)
        finally:
            done.set()
            if watcher:
                watcher.join()
    if state != "DONE":
        raise BuildFailed(f"the Beam job ended in state {state}")


def _build(config: CorpusConfig, final: CorpusConfig, args: list[str], options, tokenizer: Tokenizer | None,
           console: Console | None, min_free_bytes: int | None, config_path: str | None,
           job: tuple[Callable[..., str], tuple]) -> BuildOutcome:
    """The job, the reports and the shard set, written where `config` says; `final` is where they will live.
    `config_path` (the YAML file the config came from) only titles report.html; `job` is the Beam job's
    function and its leading arguments (the progress directory is added)."""
    _run_job(job[0], job[1], options, console)
    directory = config.output.directory
    write_report(directory, shown_as=final.output.directory, min_kept_share=config.min_kept_share)
    report = f"{final.output.directory.rstrip('/')}/{REPORT_FILE}"
    stats = read_stats(directory)
    warnings = tuple(build_warnings(directory, config.warn_share))
    vanished = tuple(vanished_sources(stats, config.min_kept_share))
    if console is not None:
        console.print()
        console.print(summary_table(stats))
        _print_findings(console, warnings, vanished)
        console.print(f"report: {report}", highlight=False)
    shards = None
    if config.tokenize is not None:
        from ember.pipelines.tokenize_pipeline import run as tokenize, write_shard_set

        if console is not None:
            console.print(f"\ntokenize + pack -> {final.shards_directory}", highlight=False)
        if storage.is_url(config.shards_directory):
            shards = _tokenize_to_url(config, final, args, tokenizer, console)
        else:
            settings = shards_config(config)
            recorded = _recorded(settings, final)
            if config.shards_directory != final.shards_directory:  # inside the staged output: written in place
                Path(settings.output_dir).mkdir(parents=True)
                write_shard_set(settings, args, tokenizer, recorded, console=console)
                shards = read_manifest(settings.output_dir)
            else:
                shards = tokenize(settings, args, overwrite=True, tokenizer=tokenizer, min_free_bytes=min_free_bytes,
                                  recorded=recorded, console=console)
        if console is not None:
            console.print(shards_table(shards))
    # After tokenize, so the page's token-length histogram reads the shard set the build just made.
    shards_read = config.shards_directory if shards else None
    if shards_read is not None and storage.is_url(shards_read):
        from ember.tokenize.remote_sets import local_shard_set

        shards_read = str(local_shard_set(shards_read))
    write_html_report(directory, config_path, shards_read,
                      shown_as=(final.output.directory, final.shards_directory if shards else None))
    if console is not None:
        console.print(f"report with charts: {final.output.directory.rstrip('/')}/{REPORT_HTML_FILE}", highlight=False)
    return BuildOutcome("DONE", args, stats, report, shards, warnings, vanished=vanished)


def preflight_urls(config: CorpusConfig, url_shards: str | None) -> None:
    """Before any work: every gs:// or s3:// input's bucket is reachable with the credentials at hand, the output and
    shard directories can be written, and a shard directory holds no set or leftovers of an interrupted run. Raises
    OutputUnusable naming the URL."""
    try:
        for source in config.sources:
            for pattern in source.inputs:
                if storage.is_url(pattern):
                    storage.preflight(pattern)
        if storage.is_url(config.output.directory):
            storage.preflight(config.output.directory, write=True)
        if url_shards is not None:
            storage.preflight(url_shards, write=True)
            storage.prepare_output(url_shards)
    except storage.StorageError as exc:
        raise OutputUnusable(str(exc)) from None


def build_corpus(config: CorpusConfig, beam_args: list[str], console: Console | None = None,
                 min_free_bytes: int | None = None, config_path: str | None = None, phases_plan: Phases = "auto") -> BuildOutcome:
    """Run the build to completion; with a console, local runs show live progress and a summary.
    `min_free_bytes` overrides the free-space floor estimated from the inputs; `phases_plan` says how a local
    build runs its phases (`Phases`)."""
    input_bytes = local_input_bytes(config)
    args, options = prepare_options(beam_args, input_bytes)
    refuse_unshared_disk(config.output.directory, options, "output.directory")
    for i, source in enumerate(config.sources):
        for pattern in source.inputs:
            refuse_unshared_disk(pattern, options, f"sources.{i}.inputs")
    if config.tokenize is not None:
        refuse_unshared_disk(config.shards_directory, options, "tokenize.output_dir")
        if config.tokenize.tokenizer.path is not None:
            refuse_unshared_disk(config.tokenize.tokenizer.path, options, "tokenize.tokenizer.path", NAMED_TOKENIZER)
    url_shards = config.shards_directory if config.shards_directory and storage.is_url(config.shards_directory) else None
    preflight_urls(config, url_shards)
    check_inputs(config)
    check_indexes(config)
    tokenizer = None
    if config.tokenize is not None:
        from ember.tokenize.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(config.tokenize.tokenizer)  # one that does not load fails before the long part
        if config.tokenize.fim is not None:
            from ember.tokenize.fim import resolve_ids

            resolve_ids(config.tokenize.fim, tokenizer)  # so do FIM tokens it lacks
    need = free_space_needed(config) if min_free_bytes is None else min_free_bytes
    local = is_local(config.output.directory)
    target = Path(os.path.abspath(config.output.directory)) if local else None
    shards = Path(os.path.abspath(config.shards_directory)) if config.shards_directory and not url_shards else None
    inside = _inside(str(shards), target) if shards and target else None
    if inside == Path("."):
        raise CorpusConfigError("tokenize.output_dir: the shard set needs its own directory, not output.directory itself")
    if shards is not None and inside is None:
        from ember.pipelines.tokenize_pipeline import check_output

        if target is not None and _inside(str(target), shards) is not None:
            raise CorpusConfigError(f"tokenize.output_dir: {shards} holds output.directory; give the shard set a directory of its own")
        check_output(shards, overwrite=True)
        check_room(shards, need, "tokenize.output_dir")
    if target is None:
        require_empty_output(config.output.directory)
        return _build(config, config, args, options, tokenizer, console, min_free_bytes, config_path, (_whole_job, (config, args)))
    final = config.model_copy(update={"output": config.output.model_copy(update={"directory": str(target)})})

    def owned(directory: Path) -> set[str]:
        """Listed by the previous build, or by the manifest of a shard set rewritten in place since."""
        from ember.pipelines.tokenize_pipeline import shard_set_files

        listed = {f"{inside.as_posix()}/{f}" for f in shard_set_files(directory / inside)} if inside else set()
        return owned_by_ownership_file(directory) | listed

    refuse_foreign(target, owned(target), "output.directory")
    check_room(target, need, "output.directory")
    keys = phases.documents_key(final)
    keys = (keys, phases.output_key(final, keys))
    phase = "phase documents"
    try:
        if (shards is None and url_shards is None) or inside is not None:  # a set elsewhere may have changed: rebuilt
            if up_to_date(target, keys[1]):
                return _unchanged(final, target, args, keys, console)
        entry = phases.cache_root(target) / f"documents-{keys[0]}"
        marker = phases.verified(entry)
        if marker is None and (phases_plan == "fused" or (phases_plan == "auto" and is_small(input_bytes))):
            phase = "phases documents + output"
            _say(console, f"phases documents + output: running as one Beam job (keys {keys[0]}, {keys[1]})")
            partial = phases.partial_entry(entry.parent, entry.name)
            job: tuple[Callable[..., str], tuple] = (phases.run_fused, (str(partial),))
        else:
            marker = _documents_phase(final, args, options, console, entry, marker)
            phase, partial = "phase output", None
            _say(console, f"phase output: running (key {keys[1]})")
            job = (phases.run_output, (str(entry), marker))
        try:
            with staged(target, owned, "output.directory") as staging:
                config_in = _staged_config(final, staging, target)
                outcome = _build(config_in, final, args, options, tokenizer, console, min_free_bytes, config_path,
                                 (job[0], (config_in, args, *job[1])))
                if partial is not None:
                    with signals_deferred():
                        phases.publish_entry(partial, entry)
                write_ownership(staging, build_key=keys[1])
        finally:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)  # gone already once published
    except Interrupted as exc:
        exc.where = exc.where or phase
        exc.state = exc.state or _interrupted_state(target, keys)
        raise
    removed = phases.prune(phases.cache_root(target), entry.name)
    if removed:
        _say(console, f"cache: removed {len(removed)} superseded entr{'y' if len(removed) == 1 else 'ies'}")
    return BuildOutcome(outcome.state, args, outcome.stats, outcome.report, outcome.shards, outcome.warnings, {
        "documents": "skipped" if marker is not None and marker.get("reused") else "ran", "output": "ran",
    }, outcome.vanished)


def _say(console: Console | None, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False)


def _documents_phase(config: CorpusConfig, args: list[str], options, console: Console | None, entry: Path,
                     marker: dict[str, Any] | None) -> dict[str, Any]:
    """The marker of the `documents` phase's verified cache `entry`: reused when complete (`marker`), else built
    (under a partial name until sealed, so an interrupted one is never taken for done)."""
    root, key = entry.parent, entry.name.removeprefix("documents-")
    if marker is not None:
        _say(console, f"phase documents: up to date (key {key}), skipped")
        return {**marker, "reused": True}
    _say(console, f"phase documents: running (key {key})")
    partial = phases.partial_entry(root, entry.name)
    try:
        _run_job(phases.run_documents, (config, args, str(partial)), options, console)
        with signals_deferred():
            phases.publish_entry(partial, entry)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    marker = phases.verified(entry)
    if marker is None:
        raise BuildFailed(f"the documents phase's cache entry {entry} does not verify right after it was written")
    return marker


def _print_findings(console: Console, warnings: tuple[SourceWarning, ...], vanished: tuple[VanishedSource, ...]) -> None:
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning.message())}", highlight=False)
    for source in vanished:
        console.print(f"[red]vanished:[/red] {escape(source.message())}", highlight=False)


def _unchanged(final: CorpusConfig, target: Path, args: list[str], keys: tuple[str, str], console: Console | None) -> BuildOutcome:
    """A rerun of the config that built `target`, over the same inputs: nothing to do."""
    _say(console, f"phase documents: up to date (key {keys[0]}), skipped")
    _say(console, f"phase output: up to date (key {keys[1]}), skipped")
    stats = read_stats(str(target))
    warnings = tuple(build_warnings(str(target), final.warn_share))
    vanished = tuple(vanished_sources(stats, final.min_kept_share))
    report = f"{target}/{REPORT_FILE}"
    if console is not None:
        console.print(summary_table(stats))
        _print_findings(console, warnings, vanished)
        console.print(f"report: {report}", highlight=False)
        console.print(f"report with charts: {target}/{REPORT_HTML_FILE}", highlight=False)
    shards = read_manifest(final.shards_directory) if final.shards_directory else None
    return BuildOutcome("DONE", args, stats, report, shards, warnings, {"documents": "skipped", "output": "skipped"}, vanished)


def _interrupted_state(target: Path, keys: tuple[str, str]) -> str:
    """Where an interrupted build left things, in one clause for the "interrupted: ..." line."""
    if up_to_date(target, keys[1]):
        return f"the build had finished: output.directory {target} is complete"
    output = (f"output.directory {target} holds the previous build, unchanged" if target.exists()
              else f"output.directory {target} was not created")
    entry = phases.cache_root(target) / f"documents-{keys[0]}"
    if phases.verified(entry) is not None:
        return f"{output}; phase documents is complete in {entry}, so a rerun of this config resumes after it"
    return f"{output}; no phase completed, so a rerun starts over"


def shards_table(manifest: Manifest) -> Table:
    budgets = any(source.target_tokens is not None for source in manifest.sources.values())
    table = Table("source", "documents", "tokens", *(["target"] if budgets else []), "sequences", "fill", "split",
                  title="shard set")
    for name, source in manifest.sources.items():
        fill = source.tokens / max(1, source.sequences * manifest.seq_len)
        target = [f"{source.target_tokens:,}" if source.target_tokens is not None else "-"] if budgets else []
        table.add_row(name, f"{source.documents:,}", f"{source.tokens:,}", *target, f"{source.sequences:,}", f"{fill:.2%}",
                      f"{source.split_documents:,}")
    return table
