"""The stages of `ember corpus build`, each a composite transform with one output shape, `StageOutput`.

A stage takes document rows and returns the rows it keeps plus its rejects, duplicate-cluster rows
and stats events, so every document that enters leaves as exactly one kept row or one reject with its
stage and reason. `CorpusFn`, the base of the stages' DoFns, owns the live-progress counters and the
shape of those tagged outputs; each subclass holds only its decision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import apache_beam as beam
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import PCollection, TaggedOutput

from ember.pipelines.quality import minhash
from ember.pipelines.quality.classifier import QUALITY_REJECT, FastTextScorer, score_bin_metric
from ember.pipelines.quality.code_filters import check_code
from ember.pipelines.quality.components import ConnectedComponents, Unconverged
from ember.pipelines.corpus import trees
from ember.pipelines.corpus.config import CorpusSource, Dedup
from ember.pipelines.quality.settings import Filters, QualityClassifier, Redaction, UrlBlocklistSettings
from ember.pipelines.corpus.formats import READ_STAGE, UNREADABLE, Row, read_file
from ember.pipelines.quality.language_id import identifier, language_verdict
from ember.pipelines.jobs.progress import ProgressWriter
from ember.pipelines.quality.redaction import RedactionTimeout, redact_fields
from ember.pipelines.web.blocklist import UrlBlocklist, parse_domain_lines
from ember.pipelines.quality.web_filters import WebFilterStack
from ember.schemas.documents import cluster_row, content_hash, reject_row

ALL_SOURCES = "*"
REJECTS = "rejects"
CLUSTERS = "clusters"
STATS = "stats"

_STARS_WIDTH = 18
_LENGTH_WIDTH = 15

Event = tuple[tuple[str, str, str], int]


class StageOutput(NamedTuple):
    """What every corpus stage returns: four PCollections, an empty one where the stage has none."""

    documents: PCollection
    rejects: PCollection
    clusters: PCollection
    stats: PCollection  # ((source, stage, metric), value) events, summed into stats.json


def _one(pipeline: beam.Pipeline, label: str, parts: Sequence[PCollection]) -> PCollection:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return pipeline | f"No{label}" >> beam.Create([])
    return parts | label >> beam.Flatten()


def stage_output(
    documents: PCollection,
    rejects: Sequence[PCollection] = (),
    clusters: Sequence[PCollection] = (),
    stats: Sequence[PCollection] = (),
) -> StageOutput:
    """A stage's outputs as one `StageOutput`: several PCollections of a kind are flattened, none is empty."""
    p = documents.pipeline
    return StageOutput(documents, _one(p, "Rejects", rejects), _one(p, "Clusters", clusters), _one(p, "Stats", stats))


TEXT_BYTES = "text_bytes"
TEXT_CHARS = "text_chars"
BAND_KEYS = "band_keys"
"""Fields of a dedup row (`SplitText`): the lengths the stats and the representative order need, and the
document's LSH band keys, standing in for its text between the documents phase and the write."""


def text_bytes(row: Row) -> int:
    return row[TEXT_BYTES] if "text" not in row else len(row["text"].encode("utf-8"))


def text_chars(row: Row) -> int:
    return row[TEXT_CHARS] if "text" not in row else len(row["text"])


def document_events(row: Row, stage: str) -> Iterator[Event]:
    """The per-stage counts of stats.json: documents and bytes that leave `stage`."""
    yield (row["source"], stage, "docs_out"), 1
    yield (row["source"], stage, "bytes_out"), text_bytes(row)


def count_documents(documents: PCollection, stage: str) -> PCollection:
    return documents | "Count" >> beam.FlatMap(document_events, stage)


class CorpusFn(beam.DoFn):
    """Base of the corpus DoFns: progress counters and the tagged reject, cluster and stats outputs."""

    STAGE = ""

    def __init__(self, progress_dir: str | None = None):
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def finish_bundle(self) -> None:
        self._progress.flush()

    def advance(self, n: int = 1) -> None:
        self._progress.add(self.STAGE, n)

    def reject(self, row: Row, reason: str, detail: str = "") -> TaggedOutput:
        return TaggedOutput(REJECTS, reject_row(row["source"], row["location"], self.STAGE, reason, detail, row["id"]))

    def cluster(self, row: Row, cluster_id: str, kept: bool) -> TaggedOutput:
        return TaggedOutput(CLUSTERS, cluster_row(row, self.STAGE, cluster_id, kept))

    def stat(self, source: str, metric: str, value: int = 1) -> TaggedOutput:
        return TaggedOutput(STATS, ((source, self.STAGE, metric), value))


# ---------------------------------------------------------------- read


class ExpandInputs(CorpusFn):
    """(source, glob) -> (source, path) for every matched file, in sorted order. A `files` source's glob
    matches repositories, each walked into (source, TreeFile) units (ember/pipelines/corpus/trees.py): the
    links it refuses and files over `max_tree_file_bytes` (rejected unread) go to the rejects; its counts
    of repositories and of ignored files and directories go to the stats."""

    STAGE = READ_STAGE

    def __init__(self, sources: dict[str, CorpusSource], max_tree_file_bytes: int, progress_dir: str | None):
        super().__init__(progress_dir)
        self._sources = sources
        self._max_bytes = max_tree_file_bytes

    def process(self, element: tuple[str, str]) -> Iterator[Any]:
        source, pattern = element
        if self._sources[source].format != "files":
            for path in sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list):
                yield source, path
            return
        for root in trees.directories(pattern):
            yield from self._walk(source, root)

    def _walk(self, source: str, root: str) -> Iterator[Any]:
        ignored = {"files_ignored": 0, "dirs_ignored": 0}
        for item in trees.walk(root):
            if isinstance(item, trees.Ignored):
                ignored["dirs_ignored" if item.directory else "files_ignored"] += 1
            elif isinstance(item, trees.TreeReject):
                self.advance()
                yield TaggedOutput(REJECTS, reject_row(source, item.path, READ_STAGE, item.reason, item.detail))
            elif item.size > self._max_bytes:
                self.advance()
                yield TaggedOutput(REJECTS, reject_row(
                    source, item.path, READ_STAGE, "file_too_large",
                    f"{item.relpath} has {item.size:,} bytes, more than {self._max_bytes:,} (4 x filters.code.max_chars): skipped unread",
                ))
            else:
                yield source, item
        yield self.stat(source, "repositories")
        for metric, n in ignored.items():
            if n:
                yield self.stat(source, metric, n)


class ReadFiles(CorpusFn):
    """(source, path) -> document rows; every malformed unit goes to the rejects output.

    Counts `files` and `files_unreadable` (files that broke part way: their lines after the break are
    unknown and stand as one `unreadable_file` reject each) on the stats output, so stats.json and the
    report say how many inputs the document counts are a lower bound for.
    """

    STAGE = READ_STAGE

    def __init__(self, sources: dict[str, CorpusSource], progress_dir: str | None):
        super().__init__(progress_dir)
        self._sources = sources

    def process(self, element: tuple[str, str | trees.TreeFile]) -> Iterator[Any]:
        source, path = element
        unreadable = False
        for row, rejected in read_file(path, self._sources[source]):
            self.advance()
            if row is not None:
                yield row
                continue
            unreadable = unreadable or rejected["reason"] == UNREADABLE
            yield TaggedOutput(REJECTS, rejected)
        yield self.stat(source, "files")
        if unreadable:
            yield self.stat(source, "files_unreadable")


class ReadSources(beam.PTransform):
    """The pipeline's root: every file of every source's globs, spread over the workers and read."""

    def __init__(self, sources: list[CorpusSource], progress_dir: str | None, max_tree_file_bytes: int):
        super().__init__()
        self._sources = sources
        self._progress_dir = progress_dir
        self._max_tree_file_bytes = max_tree_file_bytes

    def expand(self, root) -> StageOutput:
        sources = {s.name: s for s in self._sources}
        listed = (
            root
            | "Globs" >> beam.Create([(s.name, g) for s in self._sources for g in s.inputs])
            | "ExpandGlobs" >> beam.ParDo(ExpandInputs(sources, self._max_tree_file_bytes, self._progress_dir)).with_outputs(
                REJECTS, STATS, main="files"
            )
        )
        read = (
            listed.files
            | "SpreadFiles" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadFiles(sources, self._progress_dir)).with_outputs(REJECTS, STATS, main="docs")
        )
        return stage_output(read.docs, rejects=[listed[REJECTS], read[REJECTS]],
                            stats=[listed[STATS], read[STATS], count_documents(read.docs, READ_STAGE)])


class KeepFirstId(CorpusFn):
    """All rows sharing an id: the first by (content hash, location) keeps it, the others are rejected."""

    STAGE = "unique_ids"

    def process(self, element: tuple[str, Iterable[Row]]) -> Iterator[Any]:
        _, rows = element
        ordered = sorted(rows, key=lambda r: (r["content_hash"], r["location"]))
        yield ordered[0]
        for row in ordered[1:]:
            yield self.reject(row, "duplicate_id", f"id already used by {ordered[0]['location']}")


class UniqueIds(beam.PTransform):
    """Ids taken from a record field may repeat; ids made from content cannot, so only the former are checked."""

    def __init__(self, id_sources: frozenset[str]):
        super().__init__()
        self._id_sources = id_sources

    def expand(self, docs) -> StageOutput:
        id_sources = self._id_sources
        mapped = docs | "FromIdField" >> beam.Filter(lambda r: r["source"] in id_sources)
        others = docs | "ContentIds" >> beam.Filter(lambda r: r["source"] not in id_sources)
        checked = (
            mapped
            | "ById" >> beam.Map(lambda r: (r["id"], r))
            | "GroupById" >> beam.GroupByKey()
            | "KeepFirst" >> beam.ParDo(KeepFirstId()).with_outputs(REJECTS, main="docs")
        )
        return stage_output((checked.docs, others) | "Merge" >> beam.Flatten(), rejects=[checked[REJECTS]])


# ---------------------------------------------------------------- filter + redact


def load_blocklist(settings: UrlBlocklistSettings) -> UrlBlocklist:
    """The config's domains plus its file's (read on the worker, from any Beam filesystem)."""
    domains = list(settings.domains)
    if settings.file is not None:
        with FileSystems.open(settings.file, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            domains += parse_domain_lines(f.read().decode("utf-8").splitlines(), settings.file)
    return UrlBlocklist(domains)


class FilterDocuments(CorpusFn):
    """Web documents: URL block-list, language ID (into metadata) and its allow-list, then datatrove's filters
    (all built once per worker in setup); code documents: the code heuristics."""

    STAGE = "filter"

    def __init__(self, filters: Filters, progress_dir: str | None):
        super().__init__(progress_dir)
        self._filters = filters

    def setup(self) -> None:
        super().setup()
        web = self._filters.web
        self._web = WebFilterStack(web)
        self._blocklist = load_blocklist(web.url_blocklist)
        lid = web.language_id
        self._language = identifier(tuple(lid.candidates), lid.low_accuracy, lid.max_chars) if lid.enabled else None

    def _web_verdict(self, row: Row) -> tuple[Row, str, str]:
        metadata = row["metadata"] or {}
        blocked = self._blocklist.blocked_by(metadata.get("url"))
        if blocked is not None:
            return row, f"url_blocklist:{blocked}", f"host {metadata.get('url')!r} is under {blocked}"
        if self._language is not None:
            code, score = self._language.identify(row["text"])
            row = {**row, "metadata": {**metadata, "language": code, "language_score": score}}
            reason, detail = language_verdict(code, score, self._filters.web.languages, self._filters.web.min_language_score)
            if reason:
                return row, reason, detail
        text, reason, detail = self._web.apply(row["text"])
        return {**row, "text": text}, reason, detail

    def process(self, row: Row) -> Iterator[Any]:
        self.advance()
        if row["kind"] == "web":
            row, reason, detail = self._web_verdict(row)
        else:
            reason, detail = check_code(row["text"], row["metadata"] or {}, self._filters.code)
        yield self.reject(row, reason, detail) if reason else row


class ClassifyDocuments(CorpusFn):
    """The quality classifier's score of each document of the kinds it applies to, into metadata.quality_score;
    under the threshold, a `quality_classifier` reject. The model loads once per DoFn instance (setup)."""

    STAGE = "quality_classifier"

    def __init__(self, settings: QualityClassifier, progress_dir: str | None):
        super().__init__(progress_dir)
        self._settings = settings

    def setup(self) -> None:
        super().setup()
        s = self._settings
        self._scorer = FastTextScorer(s.model, s.label, s.max_chars)

    def process(self, row: Row) -> Iterator[Any]:
        self.advance()
        s = self._settings
        if row["kind"] not in s.applies_to:
            yield row
            return
        score = self._scorer.score(row["text"])
        row = {**row, "metadata": {**(row["metadata"] or {}), "quality_score": score}}
        yield self.stat(row["source"], score_bin_metric(score))  # kept and rejected alike: the report's histogram
        if score < s.threshold:
            yield self.reject(row, QUALITY_REJECT, f"{s.label} probability {score:.3f} < filters.classifier.threshold {s.threshold}")
        else:
            yield row


REDACTION_TIMEOUT = "redaction_timeout"
TIMED_OUT_FIELD = "<REDACTION_TIMEOUT>"


class RedactDocuments(CorpusFn):
    """Typed placeholders for secrets/PII in the text and in every string metadata value (a `url` with
    `?api_key=`, a `path` holding a token), counts per type on the stats output; the content hash is
    recomputed here because filters (C4's line removal) and redaction both change the text. A document
    whose redaction runs past `redaction.time_limit_s` is a `redaction_timeout` reject, so one hostile
    document costs its worker a bounded time instead of stalling it."""

    STAGE = "redact"

    def __init__(self, redaction: Redaction, progress_dir: str | None):
        super().__init__(progress_dir)
        self._redaction = redaction

    def process(self, row: Row) -> Iterator[Any]:
        self.advance()
        if self._redaction.enabled:
            try:
                row, counts = redact_fields(row, ("text", "metadata"), self._redaction)
            except RedactionTimeout as timeout:
                yield self.reject(row, REDACTION_TIMEOUT, str(timeout))
                return
            for kind, n in counts.items():
                yield self.stat(row["source"], f"redactions.{kind}", n)
            if counts:
                yield self.stat(row["source"], "docs_redacted")
        yield {**row, "content_hash": content_hash(row["text"])}


# Free-text fields of reject and cluster rows that can quote input: a filter's detail names the metadata
# path, a reader's error can quote the record, a location is an input path.
REJECT_TEXT_FIELDS = ("location", "detail")
CLUSTER_TEXT_FIELDS = ("location",)


def redact_text_fields(row: dict[str, Any], fields: tuple[str, ...], redaction: Redaction) -> dict[str, Any]:
    """`row` with each of `fields` redacted under its own `redaction.time_limit_s`; one that overruns it
    becomes `<REDACTION_TIMEOUT>` whole: the row still accounts for its document (and keeps its other
    fields, a short location beside a long detail), and never carries text that was not redacted."""
    out = dict(row)
    for field in fields:
        try:
            out = redact_fields(out, (field,), redaction)[0]
        except RedactionTimeout:
            out[field] = TIMED_OUT_FIELD
    return out


class RedactRows(beam.PTransform):
    """Reject or cluster rows of every stage (the read and filter stages reject before `redact` runs)
    with their free-text `fields` redacted like documents, so no output repeats a secret."""

    def __init__(self, redaction: Redaction, fields: tuple[str, ...]):
        super().__init__()
        self._redaction = redaction
        self._fields = fields

    def expand(self, rows: PCollection) -> PCollection:
        if not self._redaction.enabled:
            return rows
        redaction, fields = self._redaction, self._fields
        return rows | "Redact" >> beam.Map(redact_text_fields, fields, redaction)


class PerDocument(beam.PTransform):
    """A stage that decides each document on its own (filter, redact): one `CorpusFn` over the rows.

    `counted` adds the stage's docs_out/bytes_out to stats.json, as the report's per-stage table shows.
    """

    def __init__(self, fn: CorpusFn, counted: bool):
        super().__init__(label=fn.STAGE.title())
        self._fn = fn
        self._counted = counted

    def expand(self, docs) -> StageOutput:
        out = docs | self.label >> beam.ParDo(self._fn).with_outputs(REJECTS, STATS, main="docs")
        stats = [out[STATS], count_documents(out.docs, self._fn.STAGE)] if self._counted else [out[STATS]]
        return stage_output(out.docs, rejects=[out[REJECTS]], stats=stats)


# ---------------------------------------------------------------- dedup


def rank_key(row: Row, dedup: Dedup) -> str:
    """Sorts a cluster's preferred representative first: `dedup.prefer` in order, then the smallest id.

    Fixed-width fields, so plain string order is preference order for every kind of document.
    """
    metadata = row["metadata"] or {}
    parts = []
    for preference in dedup.prefer:
        if preference == "permissive_license":
            parts.append("0" if (metadata.get("license") or "") in dedup.permissive_licenses else "1")
        elif preference == "stars":
            stars = min(max(int(metadata.get("stars") or 0), 0), 10**_STARS_WIDTH - 1)
            parts.append(f"{10**_STARS_WIDTH - 1 - stars:0{_STARS_WIDTH}d}")
        else:  # longest
            parts.append(f"{10**_LENGTH_WIDTH - 1 - min(text_chars(row), 10**_LENGTH_WIDTH - 1):0{_LENGTH_WIDTH}d}")
    return "".join(parts)


def node_key(row: Row, dedup: Dedup) -> str:
    """A unique graph node per document whose order is representative order (location breaks id ties)."""
    return f"{rank_key(row, dedup)}\x00{row['id']}\x00{row['location']}"


def node_document_id(node: str) -> str:
    return node.split("\x00")[1]


def size_bin(size: int) -> str:
    """Cluster-size histogram bins: 2, 3-4, 5-8, 9-16, ..."""
    if size <= 2:
        return "2"
    upper = 1 << math.ceil(math.log2(size))
    return f"{upper // 2 + 1}-{upper}"


class ResolveCluster(CorpusFn):
    """A dedup stage's verdicts: a duplicate is rejected into its cluster, a representative records it."""

    REASON = ""

    def duplicate(self, row: Row, cluster_id: str) -> Iterator[TaggedOutput]:
        yield self.reject(row, self.REASON, f"cluster={cluster_id}")
        yield self.cluster(row, cluster_id, False)

    def representative(self, row: Row, size: int) -> Iterator[TaggedOutput]:
        yield self.cluster(row, row["id"], True)
        yield self.stat(ALL_SOURCES, "clusters")
        yield self.stat(ALL_SOURCES, f"cluster_size.{size_bin(size)}")


class ResolveExact(ResolveCluster):
    STAGE = "exact_dedup"
    REASON = "exact_duplicate"

    def __init__(self, dedup: Dedup, progress_dir: str | None):
        super().__init__(progress_dir)
        self._dedup = dedup

    def process(self, element: tuple[str, Iterable[Row]]) -> Iterator[Any]:
        _, rows = element
        best_key, best = min(((node_key(r, self._dedup), r) for r in rows), key=lambda kv: kv[0])
        size = 0
        for row in rows:  # a second pass: Beam's grouped values are re-iterable (paged on Dataflow/Flink)
            size += 1
            if node_key(row, self._dedup) != best_key:
                yield from self.duplicate(row, best["id"])
        self.advance(size)
        if size > 1:
            yield from self.representative(best, size)
        yield best


class ExactDedup(beam.PTransform):
    """Group by normalized content hash; the preferred member of each group survives."""

    def __init__(self, dedup: Dedup, progress_dir: str | None):
        super().__init__()
        self._fn = ResolveExact(dedup, progress_dir)

    def expand(self, docs) -> StageOutput:
        resolved = (
            docs
            | "ByContentHash" >> beam.Map(lambda r: (r["content_hash"], r))
            | "GroupByHash" >> beam.GroupByKey()
            | "Resolve" >> beam.ParDo(self._fn).with_outputs(REJECTS, CLUSTERS, STATS, main="docs")
        )
        return stage_output(
            resolved.docs,
            rejects=[resolved[REJECTS]],
            clusters=[resolved[CLUSTERS]],
            stats=[resolved[STATS], count_documents(resolved.docs, "exact_dedup")],
        )


def document_band_keys(text: str, dedup: Dedup) -> list[bytes]:
    """A document's LSH bucket key per band; none for a document shorter than one n-gram."""
    hashes = minhash.shingles(text, dedup.n_grams, dedup.shingle)
    if hashes.size == 0:
        return []
    sig = minhash.signature(hashes, dedup.bands * dedup.rows_per_band, dedup.seed)
    return minhash.band_keys(sig, dedup.bands, dedup.rows_per_band)


class BandKeys(beam.DoFn):
    """Document row -> (LSH bucket key, node) for each band: the keys `SplitText` computed, or from the text."""

    def __init__(self, dedup: Dedup):
        self._dedup = dedup

    def process(self, row: Row) -> Iterator[tuple[bytes, str]]:
        keys = row[BAND_KEYS] if BAND_KEYS in row else document_band_keys(row["text"], self._dedup)
        if keys:
            node = node_key(row, self._dedup)
            for key in keys:
                yield key, node


TEXTS = "texts"


def compress_text(text: str) -> bytes:
    """zstd level 1 (~250 MB/s a core here, code and prose ~3.7x smaller): every copy an in-process runner keeps of
    the texts on their way to the write is that much smaller."""
    return pa.compress(text.encode("utf-8"), codec="zstd", asbytes=True)


def decompress_text(text: Row) -> str:
    """A `texts` record's text (`SplitText`)."""
    return pa.decompress(text["zstd"], text[TEXT_BYTES], codec="zstd", asbytes=True).decode("utf-8")


class SplitTextFn(beam.DoFn):
    """A document row -> its dedup row (the row without its text, plus `TEXT_BYTES`, `TEXT_CHARS` and, for near
    dedup, `BAND_KEYS`) and, tagged `texts`, {source, id, location, TEXT_BYTES, zstd} for the write to join back."""

    def __init__(self, dedup: Dedup):
        self._dedup = dedup

    def process(self, row: Row) -> Iterator[Any]:
        text = row["text"]
        slim = {k: v for k, v in row.items() if k != "text"}
        slim[TEXT_BYTES] = len(text.encode("utf-8"))
        slim[TEXT_CHARS] = len(text)
        if self._dedup.near:
            slim[BAND_KEYS] = document_band_keys(text, self._dedup)
        yield slim
        yield TaggedOutput(TEXTS, {"source": row["source"], "id": row["id"], "location": row["location"],
                                   TEXT_BYTES: slim[TEXT_BYTES], "zstd": compress_text(text)})


class SplitText(beam.PTransform):
    """Documents -> (dedup rows, texts), so exact and near dedup shuffle ids, lengths and band keys but never the
    text: an in-process runner holds every shuffled collection in memory, and the text is most of a document.
    The write joins each kept row with its text again (`outputs.WriteParquetParts`). Band keys are computed here,
    before exact dedup, so the signature pass reads each text where it already is (exact copies, a few percent
    of a corpus, are hashed too)."""

    def __init__(self, dedup: Dedup):
        super().__init__()
        self._dedup = dedup

    def expand(self, docs):
        return docs | "Split" >> beam.ParDo(SplitTextFn(self._dedup)).with_outputs(TEXTS, main="documents")


def bucket_edges(element: tuple[bytes, Iterable[str]]) -> Iterator[tuple[str, str]]:
    """A bucket's members as a star around its smallest node: k - 1 edges, never k^2."""
    _, nodes = element
    distinct = set(nodes)
    if len(distinct) < 2:
        return
    smallest = min(distinct)
    for node in sorted(distinct):
        if node != smallest:
            yield node, smallest


EARLIER_RELEASE_REASON = "near_duplicate_of_earlier_release"
"""A new document removed for near-duplicating one of an earlier release's (`dedup.against`), counted apart."""


class ResolveNear(ResolveCluster):
    STAGE = "near_dedup"
    REASON = "near_duplicate"

    def process(self, element: tuple[str, dict[str, list]]) -> Iterator[Any]:
        _, sides = element
        parents, members = sides["parent"], sides["members"]
        for row in sides["doc"]:
            self.advance()
            if parents:
                yield from self.duplicate(row, node_document_id(parents[0]))
                continue
            if members:
                yield from self.representative(row, sum(members) + 1)
            yield row


class NearDedup(beam.PTransform):
    """MinHash LSH buckets -> star edges -> distributed connected components -> keep each component's root.
    `bands` and `resolve` are the two places an incremental build (ember/pipelines/corpus/incremental.py) differs."""

    def __init__(self, dedup: Dedup, progress_dir: str | None):
        super().__init__()
        self._dedup = dedup
        self._progress_dir = progress_dir

    def expand(self, docs) -> StageOutput:
        dedup = self._dedup
        keyed = docs | "ByNode" >> beam.Map(lambda r: (node_key(r, dedup), r))
        edges = (
            self.bands(docs | "BandKeys" >> beam.ParDo(BandKeys(dedup)))
            | "GroupBuckets" >> beam.GroupByKey()
            | "BucketEdges" >> beam.FlatMap(bucket_edges)
        )
        labels = edges | "Components" >> ConnectedComponents(dedup.max_cc_rounds)
        unconverged = (
            labels
            | "Unconverged" >> Unconverged()
            | "UnconvergedStat" >> beam.Map(lambda n: ((ALL_SOURCES, ResolveNear.STAGE, "cc_unconverged_edges"), n))
        )
        members = labels | "CountMembers" >> beam.Map(lambda e: (e[1], 1)) | "SumMembers" >> beam.CombinePerKey(sum)
        joined = {"doc": keyed, "parent": labels, "members": members} | "JoinLabels" >> beam.CoGroupByKey()
        resolved = self.resolve(joined, labels)
        return stage_output(
            resolved.documents, rejects=[resolved.rejects], clusters=[resolved.clusters], stats=[resolved.stats, unconverged]
        )

    def bands(self, keys):
        """This build's (LSH bucket key, node) pairs -> the pairs the buckets group."""
        return keys

    def resolve(self, joined, labels) -> StageOutput:
        """Each document joined with its component's root (`parent`) or member count (`members`) -> the verdicts."""
        resolved = joined | "Resolve" >> beam.ParDo(ResolveNear(self._progress_dir)).with_outputs(
            REJECTS, CLUSTERS, STATS, main="docs")
        return StageOutput(resolved.docs, resolved[REJECTS], resolved[CLUSTERS], resolved[STATS])


DEDUP_TRANSFORMS = (ExactDedup, NearDedup)
"""The stages that see dedup rows (`SplitText`) instead of documents."""
