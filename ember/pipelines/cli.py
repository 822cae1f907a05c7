"""`ember corpus ...`: build and report a corpus, tokenize it into a shard set, verify and inspect shards.

`build` and `tokenize` pass every option they do not know to Beam untouched (`--runner=...`).
Exit codes: 0 done, 1 the job or the check failed, 2 the input or the config cannot be used,
3 the build finished but a source kept no document (or less than `min_kept_share`), unless `--allow-empty-source`;
or (`build --strict`) a source lost more than `warn_share` of its documents to one reason,
130 / 143 stopped by SIGINT / SIGTERM (workers stopped, the previous output left as it was).
Beam, pyarrow and the tokenizers load inside the commands, after the config is read, so a config error
comes before seconds of imports.

Beam's, absl's and grpc's own logging (driver and workers) goes to `<output>.log` beside the output,
and to the terminal too with `--verbose`; the terminal shows progress, the summary and warnings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, NoReturn

import typer
from ember import terminal
from rich.markup import escape
from rich.table import Table
from rich.text import Text

BEAM_OPTIONS = {"allow_extra_args": True, "ignore_unknown_options": True}
VERBOSE_HELP = "Also show Beam's, absl's and grpc's logs on stderr (they always go to <output>.log beside the output)."
SOURCE_EXIT = 3  # the build finished, but a source vanished or (--strict) lost most of its documents to one reason
MIN_FREE_HELP = "Refuse to start unless the output's filesystem has this many MiB free (default: estimated from the inputs)."

app = typer.Typer(help="Corpus builds and the shard sets they produce.", no_args_is_help=True)
console = terminal.console(narrow=True)


def fail(message: object, code: int = 2) -> NoReturn:
    from ember.pipelines.jobs.logs import log_outcome

    log_outcome(str(message))
    console.print(f"[red]{escape(str(message))}[/red]", soft_wrap=True)  # paths in messages stay whole
    raise typer.Exit(code)


def stopped(exc: BaseException) -> NoReturn:
    """The one line an interrupted build or tokenize ends with (soft-wrapped: a terminal may fold it, a log keeps it
    whole), and its exit code: 128 + the signal."""
    from rich.text import Text

    from ember.pipelines.jobs.logs import log_outcome

    log_outcome(f"interrupted: {exc}")
    console.print(Text(f"interrupted: {exc}", style="red"), soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def _tokenize_config(location: str):
    """The tokenize config at a local path, or at a gs:// / s3:// URL (read here: ember.tokenize.config stays free
    of Beam, which the sampler-side policy loader must not import)."""
    from ember.configs import TokenizeConfigError
    from ember.files import is_url
    from ember.tokenize.config import load_config

    if not is_url(location):
        return load_config(location)
    from ember.storage import read_config_url

    return load_config(location, read_config_url(location, TokenizeConfigError))


@app.command("tokenize", context_settings=BEAM_OPTIONS)
def tokenize(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="YAML config, a path or gs:// / s3:// URL (see ember/tokenize/examples/tokenize.yaml)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a previous build in output_dir."),
    min_free_mb: int | None = typer.Option(None, "--min-free-mb", min=0, help=MIN_FREE_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Tokenize deduplicated Document Parquet, best-fit pack, write shuffled Arrow shards + manifest.

    Any further arguments go to Beam (default --runner=FnApiRunner), e.g. --direct_num_workers=2.
    """
    from ember.configs import TokenizeConfigError

    try:
        settings = _tokenize_config(config)
    except TokenizeConfigError as exc:
        fail(exc)
    from ember.pipelines.jobs.logs import logs_for
    from ember.pipelines.jobs.process import Interrupted, stop_on_signals

    with logs_for(str(settings.output_dir), verbose, lambda line: console.print(line, highlight=False, soft_wrap=True)):
        from ember.pipelines.jobs.output_guard import OutputUnusable
        from ember.pipelines.tokenize_pipeline import run
        from ember.tokenize.tokenizers import TokenizerLoadError

        try:
            min_free = None if min_free_mb is None else min_free_mb * 2**20
            with stop_on_signals():
                manifest = run(settings, ctx.args, overwrite=overwrite, min_free_bytes=min_free, console=console)
        except (TokenizeConfigError, TokenizerLoadError, OutputUnusable) as exc:
            fail(exc)
        except Interrupted as exc:
            out = settings.output_dir
            exc.state = exc.state or (
                f"output_dir {out}: nothing committed (the manifest is written last)" if isinstance(out, str)
                else f"output_dir {out} holds the previous shard set, unchanged" if out.exists()
                else f"output_dir {out} was not created") + "; a rerun starts the tokenize job over"
            stopped(exc)
    budgets = any(stats.target_tokens is not None for stats in manifest.sources.values())  # tokenize.mixture
    table = Table("source", "documents", "tokens", *(["target tokens"] if budgets else []), "sequences", "padding", "fill",
                  "split docs", "rejected")
    for name, stats in manifest.sources.items():
        rejected = sum((manifest.model_extra.get("rejected") or {}).get(name, {}).values())
        fill = stats.tokens / (stats.sequences * manifest.seq_len) if stats.sequences else 0.0
        table.add_row(
            name, str(stats.documents), str(stats.tokens), *([str(stats.target_tokens)] if budgets else []),
            str(stats.sequences), str(stats.padding_tokens), f"{fill:.2%}", str(stats.split_documents), str(rejected),
        )
    console.print(table)
    console.print(f"[green]OK[/green] {len(manifest.shards)} shards in {settings.output_dir}")


@app.command("verify")
def verify(directory: str = typer.Argument(..., help="Shard-set directory holding manifest.json (local, gs://, s3://).")) -> None:
    """Check a shard set against its manifest: files present, sizes, sha256, row counts. A set on an object store is
    downloaded afresh and checked byte for byte."""
    from ember.schemas import SchemaValidationError, read_manifest
    from ember.storage import StorageError
    from ember.tokenize.remote_sets import RemoteSetError, local_shard_set
    from ember.tokenize.shardset import verify_shard_set

    try:
        local = local_shard_set(directory, refresh=True)
        problems = verify_shard_set(local)
    except (FileNotFoundError, SchemaValidationError, StorageError, RemoteSetError) as exc:
        fail(exc)
    for problem in problems:
        console.print(f"[red]FAIL[/red] {problem}")
    if problems:
        raise typer.Exit(1)
    manifest = read_manifest(local)
    rows, tokens = sum(e.rows for e in manifest.shards), sum(s.tokens for s in manifest.sources.values())
    console.print(f"[green]OK[/green] {directory}: every shard matches its manifest ({len(manifest.shards):,} shards, "
                  f"{rows:,} sequences, {tokens:,} document tokens from {len(manifest.sources):,} sources)", soft_wrap=True)


@app.command("inspect")
def inspect(
    target: str = typer.Argument(
        None, help="A shard set (manifest.json) or a corpus build's output (stats.json), local, gs:// or s3://: "
        "print what it holds."),
    locate: tuple[str, int, int] = typer.Option(
        None, "--locate", metavar="SHARD ROW TOKEN",
        help="Map token TOKEN of row ROW of shard file SHARD (a path, gs:// or s3:// URL) to its source.",
    ),
    window: int = typer.Option(200, "--window", min=0, help="Characters of the document's text shown either side."),
) -> None:
    """Summarise a shard set or a build (tokenizer, sizes, each source's documents and tokens), or with --locate
    trace a training token back to its source document: the document's id and source path/URL, the token's index
    in the document's tokens, and the stored (redacted) text around it.

    With --locate the shard is first checked against its set's manifest (size, sha256, token ids in the vocabulary)."""
    located = locate is not None and locate[0] is not None
    if located == (target is not None):
        fail("give a directory to summarise, or --locate SHARD ROW TOKEN (one of the two)")
    if target is not None:
        _summarise(target)
    else:
        _locate(locate, window)


def _summarise(target: str) -> None:
    """`inspect DIR`: the shard set's manifest summary, or the build's summary and its shard set's, if it has one."""
    from ember.pipelines.jobs.logs import quiet_third_party

    with quiet_third_party():
        from ember import storage
        from ember.pipelines.corpus.build import rows_table, summary_table
        from ember.pipelines.corpus.report import read_stats
        from ember.schemas import SchemaValidationError, read_manifest
        from ember.schemas.shards import MANIFEST_FILENAME
        from ember.tokenize.remote_sets import RemoteSetError, local_shard_set
        from ember.tokenize.shardset import summary_rows

        def shard_set(directory: str) -> None:
            manifest = read_manifest(local_shard_set(directory))
            console.print(rows_table(f"shard set {directory}", summary_rows(manifest)))

        try:
            storage.preflight(target)
            if storage.exists(storage.join(target, MANIFEST_FILENAME)):
                return shard_set(target)
            if not storage.exists(storage.join(target, "stats.json")):
                fail(f"{target} holds neither a shard set ({MANIFEST_FILENAME}) nor a corpus build's output (stats.json)")
            console.print(summary_table(read_stats(target)))
            shards = storage.join(target, "shards")
            if storage.exists(storage.join(shards, MANIFEST_FILENAME)):
                shard_set(shards)
        except (storage.StorageError, RemoteSetError, SchemaValidationError, FileNotFoundError) as exc:
            fail(exc)


def _locate(locate: tuple[str, int, int], window: int) -> None:
    from ember.pipelines.jobs.logs import quiet_third_party

    with quiet_third_party():
        from ember.pipelines.locate import LocateError, locate_text
        from ember.schemas import SchemaValidationError
        from ember.tokenize.packing import locate as locate_token
        from ember.tokenize.shardset import ShardError, read_verified_row
        from ember.tokenize.tokenizers import TokenizerLoadError

        from ember.storage import StorageError
        from ember.tokenize.remote_sets import RemoteSetError, local_shard

        shard, row, token = locate
        try:
            local = local_shard(shard)
            record = read_verified_row(local, row)
        except (ShardError, SchemaValidationError, StorageError, RemoteSetError) as exc:
            fail(exc)
        try:
            if not 0 <= token < len(record["tokens"]):
                raise IndexError(f"token {token} is outside the row's {len(record['tokens'])} tokens")
            found = locate_token(record["cu_seqlens"], record["segments"], token)
        except (IndexError, ValueError) as exc:
            fail(f"{shard}: {exc}")
        console.print(f"shard {shard} row {row} token {token}: id {record['tokens'][token]}, source {record['source']}",
                      highlight=False, soft_wrap=True)
        if found is None:
            console.print(f"padding (the row's documents end at token {record['cu_seqlens'][-1]})")
            return
        segment, index = found
        console.print(
            f"document {segment['document_id']} token {index} "
            f"(this row holds its tokens [{segment['doc_token_start']}, {segment['doc_token_end']}))", highlight=False
        )
        try:
            where = locate_text(local, record["source"], segment["document_id"], index, window)
        except (LocateError, TokenizerLoadError, OSError) as exc:
            fail(f"the document's text cannot be shown: {exc}", 1)
        console.print(f"from {where.origin}", highlight=False, soft_wrap=True)  # paths stay whole, as in fail()
        console.print(f"stored in {where.documents_file}", highlight=False, soft_wrap=True)
        at = f"characters [{where.span[0]}, {where.span[1]})" if where.span else f"the document's {where.framing} token"
        console.print(f"text around {at}, redacted as stored:", highlight=False)
        console.print(Text.assemble(where.before, (where.token_text or f"<{where.framing}>", "reverse bold"), where.after))


def _corpus_config(config: str):
    """The corpus build config at `config` (a path or a gs:// / s3:// URL), or exit 2 naming what to fix."""
    from ember.configs import CorpusConfigError
    from ember.pipelines.corpus.config import load_config

    try:
        return load_config(config)
    except CorpusConfigError as exc:
        fail(exc)


@app.command("build", context_settings=BEAM_OPTIONS)
def build(
    config: str = typer.Argument(..., help="Corpus build YAML, a path or gs:// / s3:// URL (sources, filters, redaction, dedup, output)."),
    beam_args: list[str] = typer.Argument(
        None,
        help="Beam pipeline options, passed through unchanged. Default: --runner=FnApiRunner, in this process for "
        "inputs up to 8 MiB, else with --direct_running_mode=multi_processing --direct_num_workers=<cores>.",
    ),
    phases: Literal["auto", "fused", "split"] = typer.Option(
        "auto", "--phases",
        help="How a local build runs its documents and output phases: fused (one Beam job; an interrupted build "
        "starts over), split (two jobs; an interruption in output resumes after documents), or auto: fused for "
        "inputs up to 8 MiB."),
    min_free_mb: int | None = typer.Option(None, "--min-free-mb", min=0, help=MIN_FREE_HELP),
    strict: bool = typer.Option(
        False, "--strict", help=f"Exit {SOURCE_EXIT} (after writing the output) when a source lost more than warn_share "
        "of its documents to one reason."),
    allow_empty_source: bool = typer.Option(
        False, "--allow-empty-source", help=f"Exit 0, not {SOURCE_EXIT}, when a source kept no document (or less than "
        "min_kept_share of them); the vanished lines still name it."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Read, filter, redact and deduplicate code and web corpora into Parquet, with stats.json and a report;
    with a `tokenize:` section, also tokenize and pack the kept documents into a verified shard set.
    A rebuild replaces the previous output whole, only once the new one is complete, and refuses to start
    when the output holds files ember did not write. Ctrl-C (SIGINT) or SIGTERM stops it within seconds
    (exit 130 / 143); a rerun of the same config skips the phases that are complete."""
    from ember.configs import CorpusConfigError, TokenizeConfigError

    settings = _corpus_config(config)
    from ember.pipelines.jobs.logs import logs_for
    from ember.pipelines.jobs.process import Interrupted, stop_on_signals

    with logs_for(settings.output.directory, verbose, lambda line: console.print(line, highlight=False, soft_wrap=True)) as logs:
        from ember.pipelines.corpus.build import BuildFailed, build_corpus
        from ember.pipelines.jobs.output_guard import OutputUnusable
        from ember.tokenize.tokenizers import TokenizerLoadError

        min_free = None if min_free_mb is None else min_free_mb * 2**20
        try:
            with stop_on_signals():
                outcome = build_corpus(settings, list(beam_args or []), console, min_free_bytes=min_free, config_path=str(config),
                                       phases_plan=phases)
        except (CorpusConfigError, TokenizeConfigError, TokenizerLoadError, OutputUnusable) as exc:
            fail(exc)
        except BuildFailed as exc:
            fail(f"{exc} (the log: {logs.path})", 1)
        except Interrupted as exc:
            stopped(exc)
    if outcome.vanished and not allow_empty_source:
        names = ", ".join(repr(v.source) for v in outcome.vanished)
        fail(f"source {names} vanished from the output (above; the output is written): fix the filters or inputs, or "
             "pass --allow-empty-source to accept it", SOURCE_EXIT)
    if strict and outcome.warnings:
        fail(f"--strict: {len(outcome.warnings)} source warning(s) above; the output is written", SOURCE_EXIT)


@app.command("dataflow-render", context_settings=BEAM_OPTIONS)
def dataflow_render(
    config: str = typer.Argument(..., help="Corpus build YAML (a path or gs:// / s3:// URL), as `build` takes it."),
    out: Path = typer.Argument(..., help="New or empty folder for the job request, staged files and flex template spec."),
    beam_args: list[str] = typer.Argument(
        None, help="The Dataflow options `build` would get: --runner=DataflowRunner --project --region --temp_location=gs://..."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Render a Dataflow submit without sending it: the options checked as `build` checks them, then Beam's
    DataflowRunner writes the job request (OUT/job.json), the pipeline proto and packages it would stage
    (OUT/staging) and the flex template spec (OUT/flex-template.json), with no credentials and no network."""
    from ember.configs import CorpusConfigError

    settings = _corpus_config(config)
    from ember.pipelines.jobs.logs import job_logs

    with job_logs(verbose) as logs:
        console.print(f"log: {logs.write_to(out.with_name(out.name + '.log'))}", highlight=False, soft_wrap=True)
        from ember.pipelines.corpus.dataflow import render

        try:
            rendered = render(settings, list(beam_args or []), out)
        except CorpusConfigError as exc:
            fail(exc)
    console.print(f"job request: {rendered.job} ({rendered.job.stat().st_size} bytes)", highlight=False)
    console.print(f"pipeline: {rendered.transforms} transforms, {rendered.leaf_transforms} leaf", highlight=False)
    for name, size in rendered.staged.items():
        console.print(f"staged: {name} ({size} bytes)", highlight=False)
    spec = rendered.flex_spec or "not written (needs --sdk_container_image, and a checkout's infra/dataflow/metadata.json)"
    console.print(f"flex template spec: {spec}", highlight=False)


@app.command("report")
def report(
    directory: str = typer.Argument(..., help="Output directory of a finished build (local, gs:// or s3://)."),
    warn_share: float | None = typer.Option(
        None, "--warn-share", min=0, max=1,
        help="Warn about a reason rejecting more than this share of a source (default: the config default, 0.5)."),
) -> None:
    """(Re)write report.md and report.html from a build's outputs, e.g. after a Dataflow job, and print the
    summary and warnings. A shard set in DIR/shards (the tokenize stage's default) adds the token-length histogram."""
    from ember.pipelines.jobs.logs import quiet_third_party

    with quiet_third_party():
        from ember.pipelines.corpus.build import summary_table
        from ember.pipelines.corpus.config import DEFAULT_WARN_SHARE
        from ember.pipelines.corpus.report import build_warnings, read_stats, vanished_sources, write_report
        from ember.pipelines.jobs.output_guard import record_rewrites
        from ember.pipelines.corpus.report_html import write_html_report

        from ember import storage
        from ember.tokenize.remote_sets import RemoteSetError, local_shard_set

        shards = storage.join(directory, "shards")
        try:
            storage.preflight(directory)
            if storage.is_url(directory):  # the histogram reads a local copy of the set, named by its URL
                local = str(local_shard_set(shards)) if storage.exists(storage.join(shards, "manifest.json")) else None
            else:
                local = shards if Path(shards).is_dir() else None
            path = write_report(directory)
            html_path = write_html_report(directory, shards_directory=local, shown_as=(directory, shards if local else None))
            if not storage.is_url(directory):
                record_rewrites(Path(directory))
        except (storage.StorageError, RemoteSetError) as exc:
            fail(exc)
        except FileNotFoundError as exc:
            fail(f"{directory} holds no finished build: {exc}")
        console.print(summary_table(read_stats(directory)))
        for warning in build_warnings(directory, DEFAULT_WARN_SHARE if warn_share is None else warn_share):
            console.print(f"[yellow]warning:[/yellow] {escape(warning.message())}", highlight=False)
        for source in vanished_sources(read_stats(directory), 0.0):
            console.print(f"[red]vanished:[/red] {escape(source.message())}", highlight=False)
        console.print(f"report: {path}", highlight=False)
        console.print(f"report with charts: {html_path}", highlight=False)


benchmarks_app = typer.Typer(help="Evaluation sets for decontamination, in ember's benchmark form.", no_args_is_help=True)
app.add_typer(benchmarks_app, name="benchmarks")


@benchmarks_app.command("fetch")
def fetch_benchmark(
    name: str = typer.Argument(..., help="A benchmark whose data ships in an installed package: humaneval."),
    out: Path = typer.Option(..., "--out", help="Directory for <name>.jsonl (id, prompt, solution, tests)."),
) -> None:
    """Write a packaged benchmark as JSONL for a `decontamination:` section; others (MBPP, APPS, GSM8K,
    DS-1000) are supplied as local files (docs/guides/decontamination.md)."""
    from ember.pipelines.quality.decontamination import DecontaminationError, write_benchmark

    try:
        path, n = write_benchmark(name, out)
    except DecontaminationError as exc:
        fail(exc)
    console.print(f"[green]OK[/green] {n} items of {name} in {path}", highlight=False)


@app.command("decontaminate")
def decontaminate(
    prompts: Path = typer.Argument(..., help="RL prompt set: JSONL (.jsonl, .jsonl.gz) or Parquet."),
    out: Path = typer.Option(..., "--out", help="Directory for clean.<ext> and contaminated.<ext>."),
    config: Path | None = typer.Option(
        None, "--config", help="YAML with a decontamination: section (a corpus build config works as it is)."),
    benchmark: list[Path] = typer.Option(
        [], "--benchmark", help="A benchmark file in ember's form (id, prompt, solution, tests), named by its stem; "
        "repeatable. Default settings; --config sets them."),
    field: list[str] = typer.Option(["prompt"], "--field", help="Record field checked; repeatable."),
) -> None:
    """Split a prompt set into clean and contaminated rows with the corpus build's benchmark check.
    Exit codes: 0 no prompt holds a benchmark item, 1 some do (both files written), 2 unusable input (a file
    missing, not UTF-8 JSON objects, nested too deeply, without the field; a benchmark likewise; --out unwritable)."""
    from pydantic import ValidationError

    from ember.configs import CorpusConfigError, error_lines
    from ember.pipelines.corpus.config import Benchmark, Decontamination, load_decontamination
    from ember.pipelines.quality.decontamination import BenchmarkIndex, DecontaminationError, decontaminate_prompts, item_counts

    if (config is None) == (not benchmark):
        fail("give either --config (a decontamination: section) or one or more --benchmark files")
    try:
        section = load_decontamination(str(config)) if config is not None else Decontamination(
            benchmarks=[Benchmark(name=p.name.split(".")[0], paths=[str(p.resolve())]) for p in benchmark])
        index = BenchmarkIndex(section.read_items(), section.settings(), section.match_fields())
        result = decontaminate_prompts(prompts, index, field, out)
    except ValidationError as exc:  # a --benchmark file whose stem is no benchmark name
        fail(f"--benchmark: {'; '.join(error_lines(exc))}")
    except (CorpusConfigError, DecontaminationError, ValueError) as exc:
        fail(exc)
    table = Table("benchmark", "prompts matched", "items", "top items")
    for name, items in item_counts(result.matches).items():
        top = ", ".join(f"{item} ({n})" for item, n in list(items.items())[:5])
        table.add_row(name, str(sum(items.values())), str(len(items)), top)
    console.print(table)
    console.print(f"{result.rows - len(result.matches):,} of {result.rows:,} prompts clean: {result.clean}", highlight=False)
    console.print(f"{len(result.matches):,} contaminated: {result.contaminated}", highlight=False)
    if result.matches:
        raise typer.Exit(1)
