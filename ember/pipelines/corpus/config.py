"""Typed configuration of `ember corpus build`: sources, filters, redaction, dedup and outputs.

Every model forbids unknown keys so a typo fails loudly; `load_config` turns pydantic's errors into
one `CorpusConfigError` whose lines name the bad key by its dotted path (`sources.1.format: ...`). The
filter and redaction sections are the quality stages' own settings (`ember.pipelines.quality.settings`).

Defaults fit a code corpus: the licence allow-list (`PERMISSIVE_LICENSES`, with the settings) keeps the permissive OSI
licences StarCoder-class corpora keep, PSF-2.0 (the Python standard library) and MPL-2.0 included, and
`warn_share` makes a build say so when one reason drops most of a source (`--strict` fails it).
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ember import configs
from ember.configs import CorpusConfigError, StrictModel, at_most
from ember.files import is_url
from ember.pipelines.corpus.trees import directories
from ember.pipelines.quality import minhash
from ember.pipelines.quality.settings import PERMISSIVE_LICENSES, Filters, Redaction
from ember.schemas.documents import DERIVED_METADATA_KEYS, METADATA_KEYS
from ember.tokenize.config import PackSettings

if TYPE_CHECKING:  # the matcher loads with the stage, not with every config
    from ember.pipelines.quality.decontamination import BenchmarkItem, Settings


DEFAULT_WARN_SHARE = 0.5


class FieldMapping(StrictModel):
    """Where a record keeps its text, its own id and the metadata ember knows (dotted paths reach nested objects)."""

    text: str = Field(default="text", min_length=1)
    id: str | None = Field(default=None, min_length=1, description="record id; document id becomes '<source>:<id>'")
    metadata: dict[str, str] = Field(default_factory=dict, description="metadata key -> record field")

    @field_validator("metadata")
    @classmethod
    def _known_keys(cls, mapping: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(mapping) - set(METADATA_KEYS))
        if unknown:
            raise ValueError(f"unknown metadata keys {unknown}; Document metadata has {list(METADATA_KEYS)}")
        derived = sorted(set(mapping) & set(DERIVED_METADATA_KEYS))
        if derived:
            raise ValueError(f"metadata keys {derived} are set by the build (language ID, quality classifier), not mapped from a field")
        return mapping


class HtmlExtraction(StrictModel):
    """HTML -> text of `format: warc` and `format: html` sources (resiliparse, in a child process per worker thread)."""

    time_limit_s: float = Field(default=5.0, gt=0, le=600, description="per page; an overrun is an html_timeout reject")
    max_bytes: int = Field(default=10 * 2**20, ge=1, le=2**30, description="larger pages are html_too_large rejects")
    main_content: bool = Field(default=True, description="keep the main content only (no navigation, footers)")


MARKUP_FORMATS = ("warc", "html")
JSON_BYTES_PER_CHAR = 12
"""The most bytes one character of a document's text can take in a JSONL line: a character outside the BMP
written with JSON escapes is a surrogate pair, `\\ud83d\\ude00` (UTF-8 needs at most 4; a BMP escape `\\u00e9` 6)."""
DEFAULT_MAX_LINE_BYTES = 32 * 2**20
"""Room for a document at the code filters' default max_chars (1,000,000) written with every character escaped
(12 MB), plus its metadata; a worker holds a few times this per thread while it parses a line."""


class CorpusSource(StrictModel):
    """One corpus: its inputs on any Beam filesystem, their format, field mapping and mixture weight.

    `warc` reads WARC files (.warc.gz or .warc; each HTML response record is one document, its
    WARC-Record-ID the id); `html` reads one HTML page per file (the path is the id). Both extract the
    text with `html` settings; their documents are `kind: web` and take no `fields` mapping.

    `files` reads source trees: each input is a local directory glob, each directory it matches a
    repository, each file one `kind: code` document (ember/pipelines/corpus/trees.py). Local paths only:
    the walk needs the tree's symlinks and .gitignore files, which gs:// and s3:// do not have."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["code", "web"]
    inputs: list[str] = Field(min_length=1, description="file globs: local, gs://, s3://")
    format: Literal["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "warc", "html", "files"] = "jsonl"
    fields: FieldMapping = Field(default_factory=FieldMapping)
    html: HtmlExtraction = Field(default_factory=HtmlExtraction)
    weight: float = Field(default=1.0, ge=0)
    max_line_bytes: int = Field(
        default=DEFAULT_MAX_LINE_BYTES, ge=1024, le=2**31,
        description="JSONL lines longer than this (bytes before the newline) are line_too_long rejects, read past "
        "without being held in memory",
    )
    control_characters: Literal["reject", "strip"] = Field(
        default="reject",
        description="text with C0 control characters other than tab, newline, CR, form feed (NUL, ESC, ...): "
        "reject the document (reason control_characters) or strip those characters",
    )

    @model_validator(mode="after")
    def _markup_is_web(self) -> "CorpusSource":
        if self.format in MARKUP_FORMATS:
            if self.kind != "web":
                raise ValueError(f"format {self.format} reads web pages: set kind: web")
            if self.fields != FieldMapping():
                raise ValueError(f"format {self.format} takes no fields mapping (id, url and text come from the pages)")
        if self.format == "files":
            if self.kind != "code":
                raise ValueError("format files reads source trees: set kind: code")
            if self.fields != FieldMapping():
                raise ValueError("format files takes no fields mapping (id, repo, path, licence and text come from the tree)")
            urls = [g for g in self.inputs if is_url(g)]
            if urls:
                raise ValueError(f"format files reads local directories (symlinks, .gitignore files), not {urls[0]!r}: "
                                 "copy the tree to a local disk, or pack it into JSONL or Parquet")
        return self


MAX_SIGNATURE_BYTES = 2**30
"""MinHash working memory per Beam worker (Dataflow's smallest workers have a few GiB for several threads)."""


class Dedup(StrictModel):
    """Exact dedup on content hash, then MinHash LSH near dedup with distributed connected components."""

    exact: bool = True
    near: bool = True
    shingle: Literal["word", "char"] = "word"
    n_grams: Annotated[int, at_most(256, "each n-gram costs a pass over the document, and longer ones make every shingle unique")] = Field(
        default=5, ge=1
    )
    bands: Annotated[int, at_most(1024, "each band is one shuffled LSH key per document")] = Field(default=14, ge=1)
    rows_per_band: Annotated[int, at_most(256, "beyond it the LSH threshold is above 0.97 for any bands")] = Field(
        default=8, ge=1
    )
    seed: int = Field(default=1, ge=0, lt=2**63)
    max_cc_rounds: int = Field(
        default=8, ge=1, le=64, description="large-star/small-star rounds; unconverged nodes are counted in stats.json"
    )
    prefer: list[Literal["permissive_license", "stars", "longest"]] = Field(
        default_factory=lambda: ["permissive_license", "stars"],
        description="representative order within a cluster; the smallest document id breaks ties",
    )
    permissive_licenses: list[str] = Field(default_factory=lambda: list(PERMISSIVE_LICENSES))
    index: str | None = Field(
        default=None, min_length=1,
        description="save this build's MinHash band keys here (a new or empty local path, gs:// or s3://) as an index "
        "a later build's `against` dedups new documents with",
    )
    against: list[str] = Field(
        default_factory=list,
        description="indexes of earlier releases (their builds' `index`): a document that near-duplicates an indexed one "
        "is removed and counted as a duplicate of an earlier release; indexed documents are never removed",
    )

    @field_validator("prefer")
    @classmethod
    def _no_repeats(cls, prefer: list[str]) -> list[str]:
        if len(set(prefer)) != len(prefer):
            raise ValueError(f"each preference may appear once, got {prefer}")
        return prefer

    @model_validator(mode="after")
    def _index_needs_near_dedup(self) -> "Dedup":
        if not self.near and (self.index or self.against):
            raise ValueError("index and against are MinHash indexes of near dedup: set near: true or leave them out")
        return self

    @model_validator(mode="after")
    def _signature_fits_a_worker(self) -> "Dedup":
        if self.near:
            need = minhash.signature_peak_bytes(self.num_hashes)
            if need > MAX_SIGNATURE_BYTES:
                raise ValueError(
                    f"bands x rows_per_band = {self.num_hashes:,} hashes need about {configs.gib(need)} per worker "
                    f"for MinHash signatures; at most {configs.gib(MAX_SIGNATURE_BYTES)} (fewer bands or rows)"
                )
        return self

    @property
    def num_hashes(self) -> int:
        return self.bands * self.rows_per_band

    @property
    def threshold(self) -> float:
        """Jaccard where LSH inclusion probability crosses ~1/2: (1/bands)^(1/rows)."""
        return (1 / self.bands) ** (1 / self.rows_per_band)


class BenchmarkFields(StrictModel):
    """Which record keys hold a benchmark item's id, prompt, solution and tests (null: the file has none)."""

    id: str = Field(default="id", min_length=1)
    prompt: str | None = Field(default="prompt", min_length=1)
    solution: str | None = Field(default="solution", min_length=1)
    tests: str | None = Field(default="tests", min_length=1)


class Benchmark(StrictModel):
    """One evaluation set in local JSONL/Parquet files (`ember corpus benchmarks fetch` writes HumanEval's)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    paths: list[str] = Field(min_length=1, description="local files; relative paths resolve against the config's directory")
    format: Literal["jsonl", "parquet"] | None = Field(default=None, description="default: from each file's suffix")
    fields: BenchmarkFields = Field(default_factory=BenchmarkFields)
    match: list[Literal["prompt", "solution", "tests"]] = Field(
        default_factory=lambda: ["prompt", "solution"], min_length=1, description="the fields a document is checked against"
    )

    @model_validator(mode="after")
    def _matched_fields_mapped(self) -> "Benchmark":
        unmapped = [f for f in self.match if getattr(self.fields, f) is None]
        if unmapped:
            raise ValueError(f"match lists {unmapped} but fields maps them to null; map them or drop them from match")
        return self


class Decontamination(StrictModel):
    """Drop documents holding a benchmark item (ember/pipelines/quality/decontamination.py says how they are matched)."""

    benchmarks: list[Benchmark] = Field(min_length=1)
    n_grams: Annotated[int, at_most(64, "longer n-grams miss an item copied with a small edit")] = Field(default=13, ge=5)
    min_substring_tokens: int = Field(
        default=8, ge=3, description="shorter prompts/solutions (`return a + b`) are too common to match whole"
    )
    max_item_share: float = Field(
        default=0.05, gt=0, le=1, description="n-grams in more than this share of a benchmark's items are ignored"
    )
    min_overlap: float = Field(default=0.5, gt=0, le=1, description="share of an item field's n-grams a document must hold")
    min_shared: int = Field(default=3, ge=1, description="and at least this many of them")
    identifiers: bool = Field(default=True, description="also match n-grams with identifiers renamed")
    applies_to: list[Literal["code", "web"]] = Field(default_factory=lambda: ["code", "web"], min_length=1)

    @field_validator("benchmarks")
    @classmethod
    def _unique_benchmarks(cls, benchmarks: list[Benchmark]) -> list[Benchmark]:
        return configs.unique_names(benchmarks, "benchmark names")

    def settings(self) -> Settings:
        """The matching parameters in the pure module's form."""
        from ember.pipelines.quality.decontamination import Settings

        return Settings(n_grams=self.n_grams, min_substring_tokens=self.min_substring_tokens,
                        max_item_share=self.max_item_share, min_overlap=self.min_overlap, min_shared=self.min_shared,
                        identifiers=self.identifiers)

    def read_items(self) -> list[BenchmarkItem]:
        """Every benchmark's items; a missing or malformed file is a `CorpusConfigError` naming it."""
        from ember.pipelines.quality.decontamination import DecontaminationError, read_items

        items, problems = [], []
        for i, benchmark in enumerate(self.benchmarks):
            fields = benchmark.fields.model_dump()
            for j, path in enumerate(benchmark.paths):
                try:
                    items += read_items(benchmark.name, path, fields, benchmark.format)
                except DecontaminationError as exc:
                    problems.append(f"decontamination.benchmarks.{i}.paths.{j}: {exc}")
        if problems:
            raise CorpusConfigError("benchmarks are unusable:\n  " + "\n  ".join(problems))
        return items

    def match_fields(self) -> dict[str, tuple[str, ...]]:
        return {b.name: tuple(b.match) for b in self.benchmarks}


class Output(StrictModel):
    directory: str = Field(min_length=1, description="local path or any Beam filesystem URL")
    rows_per_shard: Annotated[int, at_most(1_000_000, "a Parquet part is grouped and written in one worker's memory")] = Field(
        default=50_000, ge=1, description="target rows per Parquet shard (shards per source follow)"
    )


class TokenizeStage(PackSettings):
    """`tokenize:` makes the build the whole mid-training data prep: the kept documents of every
    source are tokenized and packed into a verified shard set, weighted by the sources' weights."""

    output_dir: str | None = Field(default=None, description="shard directory (local, gs://, s3://); default <output.directory>/shards")


class CorpusConfig(StrictModel):
    _expanded: dict[str, str] = PrivateAttr(default_factory=dict)
    """Values that came from `${VAR}` -> as written: the input checks run after validation, on plain strings."""

    sources: list[CorpusSource] = Field(min_length=1)
    filters: Filters = Field(default_factory=Filters)
    redaction: Redaction = Field(default_factory=Redaction)
    dedup: Dedup = Field(default_factory=Dedup)
    output: Output
    tokenize: TokenizeStage | None = None
    decontamination: Decontamination | None = None
    warn_share: float = Field(
        default=DEFAULT_WARN_SHARE, gt=0, le=1,
        description="warn when one reason rejects more than this share of a source's documents; --strict fails then",
    )
    min_kept_share: float = Field(
        default=0.0, ge=0, le=1,
        description="a source that keeps no document, or less than this share of them, fails the build (exit 3) "
        "unless --allow-empty-source: its mixture weight would vanish from the output unnoticed",
    )

    @property
    def max_tree_file_bytes(self) -> int:
        """The largest file a `files` source reads: 4 bytes (UTF-8's most) per character of filters.code.max_chars,
        as a larger file can never be kept; 32 MiB, the default JSONL line cap, when max_chars is off."""
        max_chars = self.filters.code.max_chars
        return 4 * max_chars if max_chars is not None else DEFAULT_MAX_LINE_BYTES

    @property
    def shards_directory(self) -> str | None:
        if self.tokenize is None:
            return None
        return self.tokenize.output_dir or f"{self.output.directory.rstrip('/')}/shards"

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, sources: list[CorpusSource]) -> list[CorpusSource]:
        return configs.unique_names(sources)

    @model_validator(mode="after")
    def _lines_hold_the_longest_kept_document(self) -> "CorpusConfig":
        """A code document the filters keep must fit in a line: otherwise it would be lost as line_too_long."""
        max_chars = self.filters.code.max_chars
        need = JSON_BYTES_PER_CHAR * max_chars if max_chars is not None else 0
        configs.check([
            (f"sources.{i}.max_line_bytes", f"{s.max_line_bytes:,} is less than {JSON_BYTES_PER_CHAR} x filters.code.max_chars "
             f"= {need:,}, the longest line a kept document can take (JSON escapes); raise it or lower max_chars")
            for i, s in enumerate(self.sources)
            if s.kind == "code" and s.format.startswith("jsonl") and s.max_line_bytes < need
        ])
        return self


def parse_config(data: object, where: str = "config") -> CorpusConfig:
    config = configs.validate(CorpusConfig, data, where, CorpusConfigError)
    config._expanded = {str(value): value.written for value in configs.expansions(data)}
    return config


def _resolve(base: str, path: str) -> str:
    if is_url(path) or posixpath.isabs(path):
        return path
    return posixpath.normpath(posixpath.join(base, path)) if not is_url(base) else f"{base.rstrip('/')}/{path}"


def load_config(path: str) -> CorpusConfig:
    """Read YAML from a local file or a gs:// / s3:// URL; relative inputs and output resolve against the file's directory."""
    path = str(path)
    if is_url(path):
        from ember.storage import read_config_url  # Beam and boto3: imported only for a URL

        data = read_config_url(path, CorpusConfigError)
    else:
        try:
            with open(path, "rb") as handle:
                data = configs.read_config_bytes(handle.read)
        except OSError as exc:
            raise CorpusConfigError(f"{path}: cannot read the config file: {exc}") from None
    config = parse_config(configs.parse_yaml_bytes(data, path, CorpusConfigError), path)
    base = posixpath.dirname(path) if is_url(path) else posixpath.dirname(posixpath.abspath(path))
    tokenize = config.tokenize
    if tokenize is not None:
        tokenize = tokenize.model_copy(
            update={
                "tokenizer": tokenize.tokenizer if tokenize.tokenizer.path is None
                else tokenize.tokenizer.model_copy(update={"path": Path(_resolve(base, str(tokenize.tokenizer.path)))}),
                "output_dir": tokenize.output_dir and _resolve(base, tokenize.output_dir),
            }
        )
    blocklist = config.filters.web.url_blocklist
    if blocklist.file is not None:
        web = config.filters.web.model_copy(update={"url_blocklist": blocklist.model_copy(update={"file": _resolve(base, blocklist.file)})})
        config = config.model_copy(update={"filters": config.filters.model_copy(update={"web": web})})
    classifier = config.filters.classifier
    if classifier is not None:
        classifier = classifier.model_copy(update={"model": _resolve(base, classifier.model)})
        config = config.model_copy(update={"filters": config.filters.model_copy(update={"classifier": classifier})})
    return config.model_copy(
        update={
            "sources": [s.model_copy(update={"inputs": [_resolve(base, g) for g in s.inputs]}) for s in config.sources],
            "output": config.output.model_copy(update={"directory": _resolve(base, config.output.directory)}),
            "tokenize": tokenize,
            "decontamination": resolve_benchmarks(config.decontamination, base),
        }
    )


def resolve_benchmarks(decontamination: Decontamination | None, base: str) -> Decontamination | None:
    """Benchmark paths made absolute against `base` (the config file's directory)."""
    if decontamination is None:
        return None
    return decontamination.model_copy(update={"benchmarks": [
        b.model_copy(update={"paths": [_resolve(base, p) for p in b.paths]}) for b in decontamination.benchmarks
    ]})


def load_decontamination(path: str) -> Decontamination:
    """The `decontamination:` section of a YAML file (a corpus build config, or a file holding only that
    section), benchmark paths resolved against the file's directory."""
    data = configs.read_yaml_mapping(path, CorpusConfigError)
    if "decontamination" not in data:
        raise CorpusConfigError(f"{path}: no decontamination: section (benchmarks, n_grams, ...)")
    section = configs.validate(Decontamination, data["decontamination"], f"{path} decontamination", CorpusConfigError)
    return resolve_benchmarks(section, posixpath.dirname(posixpath.abspath(path)))


def check_inputs(config: CorpusConfig) -> None:
    """Every glob must match at least one file: an empty or unreadable glob is a config error, not an empty corpus."""
    from apache_beam.io.filesystems import FileSystems

    problems = []
    for i, source in enumerate(config.sources):
        for j, pattern in enumerate(source.inputs):
            if source.format == "files":
                if not directories(pattern):
                    problems.append(f"sources.{i}.inputs.{j}: '{pattern}' matches no directory")
                continue
            try:
                matched = FileSystems.match([pattern], limits=[1])[0].metadata_list
            except Exception as exc:  # BeamIOError for unreachable buckets, bad schemes, permissions
                problems.append(f"sources.{i}.inputs.{j}: cannot list '{pattern}': {exc}")
                continue
            if not matched:
                problems.append(f"sources.{i}.inputs.{j}: '{pattern}' matches no file")
    if config.decontamination is not None:
        for i, benchmark in enumerate(config.decontamination.benchmarks):
            for j, path in enumerate(benchmark.paths):
                if not Path(path).is_file():
                    problems.append(f"decontamination.benchmarks.{i}.paths.{j}: benchmark file '{path}' not found")
    blocklist = config.filters.web.url_blocklist.file
    if blocklist is not None and not FileSystems.exists(blocklist):
        problems.append(f"filters.web.url_blocklist.file: '{blocklist}' does not exist")
    classifier = config.filters.classifier
    if classifier is not None:  # loaded here once, so a bad file or label fails before any work
        from ember.pipelines.quality.classifier import ClassifierError, FastTextScorer

        try:
            FastTextScorer(classifier.model, classifier.label, classifier.max_chars)
        except ClassifierError as exc:
            problems.append(f"filters.classifier.model: {exc}")
    if problems:
        raise CorpusConfigError(configs.conceal("inputs are unusable:\n  " + "\n  ".join(problems), config._expanded))
