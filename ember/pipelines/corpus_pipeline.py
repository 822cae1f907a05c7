"""`ember corpus build` as one Beam graph: read -> filter -> redact -> exact dedup -> near dedup -> write.

Each stage is a PTransform with a main output of document rows and tagged outputs for rejects,
duplicate-cluster rows and stats events, so every document that enters leaves as exactly one kept
row or one reject with its stage and reason (stats.json checks docs_in = kept + rejected).

Outputs under `output.directory`:
  documents/<source>/part-SSSSS-of-NNNNN.parquet  kept rows (DOCUMENT_SCHEMA), zstd, sorted by id
  rejects/part-...parquet                         REJECTED_SCHEMA, sorted by (source, location, stage)
  clusters/part-...parquet                        CLUSTER_SCHEMA: every member of every duplicate cluster
  stats.json                                      per-source, per-stage counts (see `assemble_stats`)
Shard assignment hashes the row key and shard counts follow the row counts, so a rerun on the same
input writes byte-identical files on any runner.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsDict, TaggedOutput

from ember.pipelines import minhash
from ember.pipelines.code_filters import check_code
from ember.pipelines.components import ConnectedComponents, Unconverged
from ember.pipelines.corpus_config import CorpusConfig, Dedup, Filters, Redaction, SourceConfig
from ember.pipelines.corpus_io import READ_STAGE, Row, read_file, reject, write_parquet
from ember.pipelines.progress import ProgressWriter
from ember.pipelines.redaction import redact
from ember.pipelines.web_filters import WebFilterStack
from ember.schemas.documents import DOCUMENT_SCHEMA, REJECTED_SCHEMA, content_hash
from ember.schemas.versioning import versioned_schema

STATS_FILE = "stats.json"
STATS_SCHEMA = "ember.corpus_stats"
STATS_VERSION = 1
OUTPUT_DIRS = ("documents", "rejects", "clusters")
ALL_SOURCES = "*"
UNIQUE_IDS_STAGE = "unique_ids"

REJECTS = "rejects"
CLUSTERS = "clusters"
STATS = "stats"

CLUSTER_SCHEMA = versioned_schema(
    "DuplicateCluster",
    1,
    [
        pa.field("document_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("cluster_id", pa.string(), nullable=False),
        pa.field("kept", pa.bool_(), nullable=False),
    ],
)

_STARS_WIDTH = 18
_LENGTH_WIDTH = 15


# ---------------------------------------------------------------- pure helpers


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
            parts.append(f"{10**_LENGTH_WIDTH - 1 - min(len(row['text']), 10**_LENGTH_WIDTH - 1):0{_LENGTH_WIDTH}d}")
    return "".join(parts)


def node_key(row: Row, dedup: Dedup) -> str:
    """A unique graph node per document whose order is representative order (location breaks id ties)."""
    return f"{rank_key(row, dedup)}\x00{row['id']}\x00{row['location']}"


def node_document_id(node: str) -> str:
    return node.split("\x00")[1]


def stable_shard(key: str, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little") % shards


def size_bin(size: int) -> str:
    """Cluster-size histogram bins: 2, 3-4, 5-8, 9-16, ..."""
    if size <= 2:
        return "2"
    upper = 1 << math.ceil(math.log2(size))
    return f"{upper // 2 + 1}-{upper}"


def text_bytes(row: Row) -> int:
    return len(row["text"].encode("utf-8"))


def cluster_row(row: Row, stage: str, cluster_id: str, kept: bool) -> Row:
    return {
        "document_id": row["id"],
        "source": row["source"],
        "location": row["location"],
        "stage": stage,
        "cluster_id": cluster_id,
        "kept": kept,
    }


def assemble_stats(pairs: Iterable[tuple[tuple[str, str, str], int]], config: CorpusConfig) -> dict[str, Any]:
    """stats.json from summed ((source, stage, metric), value) events: per source, per stage, and totals."""
    sources: dict[str, Any] = {
        s.name: {"kind": s.kind, "weight": s.weight, "docs_in": 0, "bytes_in": 0, "kept": 0, "bytes_kept": 0,
                 "stages": {}, "rejected": {}, "redactions": {}}
        for s in config.sources
    }
    dedup: dict[str, Any] = {"exact_dedup": {"clusters": 0, "removed": 0, "cluster_sizes": {}},
                             "near_dedup": {"clusters": 0, "removed": 0, "cluster_sizes": {},
                                            "cc_max_rounds": config.dedup.max_cc_rounds, "cc_unconverged_edges": 0,
                                            "jaccard_threshold": round(config.dedup.threshold, 4)}}
    for (source, stage, metric), value in sorted(pairs):
        if source == ALL_SOURCES:
            if metric.startswith("cluster_size."):
                sizes = dedup[stage]["cluster_sizes"]
                sizes[metric.split(".", 1)[1]] = value
            else:
                dedup[stage][metric] = value
            continue
        entry = sources[source]
        if metric.startswith("rejected."):
            reason = metric.split(".", 1)[1]
            entry["stages"].setdefault(stage, {}).setdefault("rejected", {})[reason] = value
            entry["rejected"][f"{stage}:{reason}"] = value
            entry["docs_in"] += value if stage == READ_STAGE else 0
            if stage in dedup:
                dedup[stage]["removed"] += value
        elif metric.startswith("redactions."):
            entry["redactions"][metric.split(".", 1)[1]] = value
        else:
            entry["stages"].setdefault(stage, {})[metric] = value
    for name, entry in sources.items():
        read = entry["stages"].get(READ_STAGE, {})
        entry["docs_in"] += read.get("docs_out", 0)
        entry["bytes_in"] = read.get("bytes_out", 0)
        final = entry["stages"].get("output", {})
        entry["kept"] = final.get("docs_out", 0)
        entry["bytes_kept"] = final.get("bytes_out", 0)
        entry["rejected_total"] = sum(entry["rejected"].values())
        entry["balanced"] = entry["docs_in"] == entry["kept"] + entry["rejected_total"]
    for stage in dedup.values():
        stage["cluster_sizes"] = dict(sorted(stage["cluster_sizes"].items(), key=lambda kv: int(kv[0].split("-")[0])))
    rejected_by_reason: dict[str, int] = {}
    for entry in sources.values():
        for reason, n in entry["rejected"].items():
            rejected_by_reason[reason] = rejected_by_reason.get(reason, 0) + n
    totals = {
        "docs_in": sum(e["docs_in"] for e in sources.values()),
        "bytes_in": sum(e["bytes_in"] for e in sources.values()),
        "kept": sum(e["kept"] for e in sources.values()),
        "bytes_kept": sum(e["bytes_kept"] for e in sources.values()),
        "rejected": sum(e["rejected_total"] for e in sources.values()),
        "rejected_by_reason": dict(sorted(rejected_by_reason.items())),
        "redactions": {},
    }
    for entry in sources.values():
        for kind, n in entry["redactions"].items():
            totals["redactions"][kind] = totals["redactions"].get(kind, 0) + n
    totals["balanced"] = totals["docs_in"] == totals["kept"] + totals["rejected"]
    return {"schema": STATS_SCHEMA, "version": STATS_VERSION, "totals": totals, "sources": sources, "dedup": dedup}


# ---------------------------------------------------------------- read


class ExpandInputs(beam.DoFn):
    """(source, glob) -> (source, path) for every matched file, in sorted order."""

    def process(self, element: tuple[str, str]) -> Iterator[tuple[str, str]]:
        source, pattern = element
        for path in sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list):
            yield source, path


class ReadFiles(beam.DoFn):
    """(source, path) -> document rows; every malformed unit goes to the rejects output."""

    def __init__(self, sources: dict[str, SourceConfig], progress_dir: str | None):
        self._sources = sources
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, element: tuple[str, str]) -> Iterator[Any]:
        source, path = element
        for row, rejected in read_file(path, self._sources[source]):
            self._progress.add("read")
            yield row if row is not None else TaggedOutput(REJECTS, rejected)

    def finish_bundle(self) -> None:
        self._progress.flush()


def _keep_first_id(element: tuple[str, Iterable[Row]]) -> Iterator[Any]:
    doc_id, rows = element
    ordered = sorted(rows, key=lambda r: (r["content_hash"], r["location"]))
    yield ordered[0]
    for row in ordered[1:]:
        detail = f"id already used by {ordered[0]['location']}"
        yield TaggedOutput(REJECTS, reject(row["source"], row["location"], UNIQUE_IDS_STAGE, "duplicate_id", detail, doc_id))


class UniqueIds(beam.PTransform):
    """Ids taken from a record field may repeat; the first by (content hash, location) keeps the id."""

    def __init__(self, id_sources: frozenset[str]):
        super().__init__()
        self._id_sources = id_sources

    def expand(self, docs):
        id_sources = self._id_sources
        mapped = docs | "FromIdField" >> beam.Filter(lambda r: r["source"] in id_sources)
        others = docs | "ContentIds" >> beam.Filter(lambda r: r["source"] not in id_sources)
        checked = (
            mapped
            | "ById" >> beam.Map(lambda r: (r["id"], r))
            | "GroupById" >> beam.GroupByKey()
            | "KeepFirst" >> beam.FlatMap(_keep_first_id).with_outputs(REJECTS, main="docs")
        )
        return (checked.docs, others) | "Merge" >> beam.Flatten(), checked[REJECTS]


# ---------------------------------------------------------------- filter + redact


class FilterDocuments(beam.DoFn):
    """datatrove's web filters (built once per worker in setup) or the code heuristics, by document kind."""

    def __init__(self, filters: Filters, progress_dir: str | None):
        self._filters = filters
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._web = WebFilterStack(self._filters.web)
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, row: Row) -> Iterator[Any]:
        self._progress.add("filter")
        if row["kind"] == "web":
            text, reason, detail = self._web.apply(row["text"])
            if text is None:
                yield TaggedOutput(REJECTS, reject(row["source"], row["location"], "filter", reason, detail, row["id"]))
                return
            row = {**row, "text": text}
        else:
            reason, detail = check_code(row["text"], row["metadata"] or {}, self._filters.code)
            if reason:
                yield TaggedOutput(REJECTS, reject(row["source"], row["location"], "filter", reason, detail, row["id"]))
                return
        yield row

    def finish_bundle(self) -> None:
        self._progress.flush()


class RedactDocuments(beam.DoFn):
    """Typed placeholders for secrets/PII, counts per type on the stats output; the content hash is
    recomputed here because filters (C4's line removal) and redaction both change the text."""

    def __init__(self, redaction: Redaction, progress_dir: str | None):
        self._redaction = redaction
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, row: Row) -> Iterator[Any]:
        self._progress.add("redact")
        text = row["text"]
        if self._redaction.enabled:
            text, counts = redact(text, self._redaction)
            for kind, n in counts.items():
                yield TaggedOutput(STATS, ((row["source"], "redact", f"redactions.{kind}"), n))
            if counts:
                yield TaggedOutput(STATS, ((row["source"], "redact", "docs_redacted"), 1))
        yield {**row, "text": text, "content_hash": content_hash(text)}

    def finish_bundle(self) -> None:
        self._progress.flush()


# ---------------------------------------------------------------- exact dedup


class _ResolveExact(beam.DoFn):
    def __init__(self, dedup: Dedup, progress_dir: str | None):
        self._dedup = dedup
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, element: tuple[str, Iterable[Row]]) -> Iterator[Any]:
        _, rows = element
        best_key, best = min(((node_key(r, self._dedup), r) for r in rows), key=lambda kv: kv[0])
        size = 0
        for row in rows:  # a second pass: Beam's grouped values are re-iterable (paged on Dataflow/Flink)
            size += 1
            if node_key(row, self._dedup) != best_key:
                detail = f"cluster={best['id']}"
                yield TaggedOutput(REJECTS, reject(row["source"], row["location"], "exact_dedup", "exact_duplicate", detail, row["id"]))
                yield TaggedOutput(CLUSTERS, cluster_row(row, "exact_dedup", best["id"], False))
        self._progress.add("exact_dedup", size)
        if size > 1:
            yield TaggedOutput(CLUSTERS, cluster_row(best, "exact_dedup", best["id"], True))
            yield TaggedOutput(STATS, ((ALL_SOURCES, "exact_dedup", "clusters"), 1))
            yield TaggedOutput(STATS, ((ALL_SOURCES, "exact_dedup", f"cluster_size.{size_bin(size)}"), 1))
        yield best

    def finish_bundle(self) -> None:
        self._progress.flush()


class ExactDedup(beam.PTransform):
    """Group by normalized content hash; the preferred member of each group survives."""

    def __init__(self, dedup: Dedup, progress_dir: str | None):
        super().__init__()
        self._dedup = dedup
        self._progress_dir = progress_dir

    def expand(self, docs):
        return (
            docs
            | "ByContentHash" >> beam.Map(lambda r: (r["content_hash"], r))
            | "GroupByHash" >> beam.GroupByKey()
            | "Resolve" >> beam.ParDo(_ResolveExact(self._dedup, self._progress_dir)).with_outputs(
                REJECTS, CLUSTERS, STATS, main="docs"
            )
        )


# ---------------------------------------------------------------- near dedup


class BandKeys(beam.DoFn):
    """Document row -> (LSH bucket key, node) for each band; documents shorter than one n-gram get none."""

    def __init__(self, dedup: Dedup):
        self._dedup = dedup

    def process(self, row: Row) -> Iterator[tuple[bytes, str]]:
        d = self._dedup
        hashes = minhash.shingles(row["text"], d.n_grams, d.shingle)
        if hashes.size == 0:
            return
        sig = minhash.signature(hashes, d.bands * d.rows_per_band, d.seed)
        node = node_key(row, d)
        for key in minhash.band_keys(sig, d.bands, d.rows_per_band):
            yield key, node


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


class _ResolveNear(beam.DoFn):
    def __init__(self, progress_dir: str | None):
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, element: tuple[str, dict[str, list]]) -> Iterator[Any]:
        _, sides = element
        parents, members = sides["parent"], sides["members"]
        for row in sides["doc"]:
            self._progress.add("near_dedup")
            if parents:
                cluster_id = node_document_id(parents[0])
                detail = f"cluster={cluster_id}"
                yield TaggedOutput(REJECTS, reject(row["source"], row["location"], "near_dedup", "near_duplicate", detail, row["id"]))
                yield TaggedOutput(CLUSTERS, cluster_row(row, "near_dedup", cluster_id, False))
                continue
            if members:
                size = sum(members) + 1
                yield TaggedOutput(CLUSTERS, cluster_row(row, "near_dedup", row["id"], True))
                yield TaggedOutput(STATS, ((ALL_SOURCES, "near_dedup", "clusters"), 1))
                yield TaggedOutput(STATS, ((ALL_SOURCES, "near_dedup", f"cluster_size.{size_bin(size)}"), 1))
            yield row

    def finish_bundle(self) -> None:
        self._progress.flush()


class NearDedup(beam.PTransform):
    """MinHash LSH buckets -> star edges -> distributed connected components -> keep each component's root."""

    def __init__(self, dedup: Dedup, progress_dir: str | None):
        super().__init__()
        self._dedup = dedup
        self._progress_dir = progress_dir

    def expand(self, docs):
        dedup = self._dedup
        keyed = docs | "ByNode" >> beam.Map(lambda r: (node_key(r, dedup), r))
        edges = (
            docs
            | "BandKeys" >> beam.ParDo(BandKeys(dedup))
            | "GroupBuckets" >> beam.GroupByKey()
            | "BucketEdges" >> beam.FlatMap(bucket_edges)
        )
        labels = edges | "Components" >> ConnectedComponents(dedup.max_cc_rounds)
        unconverged = (
            labels
            | "Unconverged" >> Unconverged()
            | "UnconvergedStat" >> beam.Map(lambda n: ((ALL_SOURCES, "near_dedup", "cc_unconverged_edges"), n))
        )
        members = labels | "CountMembers" >> beam.Map(lambda e: (e[1], 1)) | "SumMembers" >> beam.CombinePerKey(sum)
        resolved = (
            {"doc": keyed, "parent": labels, "members": members}
            | "JoinLabels" >> beam.CoGroupByKey()
            | "Resolve" >> beam.ParDo(_ResolveNear(self._progress_dir)).with_outputs(REJECTS, CLUSTERS, STATS, main="docs")
        )
        stats = (resolved[STATS], unconverged) | "NearStats" >> beam.Flatten()
        return resolved.docs, resolved[REJECTS], resolved[CLUSTERS], stats


# ---------------------------------------------------------------- outputs


class _WriteShard(beam.DoFn):
    def __init__(self, schema: pa.Schema, sort_fields: tuple[str, ...], progress_dir: str | None):
        self._schema = schema
        self._sort_fields = sort_fields
        self._progress_dir = progress_dir

    def setup(self) -> None:
        self._progress = ProgressWriter(self._progress_dir)

    def process(self, element: tuple[str, Iterable[Row]]) -> Iterator[str]:
        path, rows = element
        ordered = sorted(rows, key=lambda r: tuple(r.get(f) or "" for f in self._sort_fields))
        write_parquet(path, ordered, self._schema)
        self._progress.add("write", len(ordered))
        yield path

    def finish_bundle(self) -> None:
        self._progress.flush()


def _shard_path(row: Row, counts: dict[str, int], prefix: str, group_field: str | None, key_field: str, per_shard: int) -> tuple[str, Row]:
    group = row[group_field] if group_field else ""
    shards = max(1, math.ceil(counts[group] / per_shard))
    shard = stable_shard(f"{row[key_field]}\x00{row.get('location', '')}", shards)
    folder = f"{prefix}/{group}" if group_field else prefix
    return f"{folder}/part-{shard:05d}-of-{shards:05d}.parquet", row


class WriteShards(beam.PTransform):
    """Rows -> `prefix[/group]/part-SSSSS-of-NNNNN.parquet`, shard count from the group's row count."""

    def __init__(self, prefix: str, schema: pa.Schema, group_field: str | None, key_field: str,
                 sort_fields: tuple[str, ...], rows_per_shard: int, progress_dir: str | None):
        super().__init__()
        self._args = (prefix, group_field, key_field, rows_per_shard)
        self._schema = schema
        self._sort_fields = sort_fields
        self._progress_dir = progress_dir

    def expand(self, rows):
        prefix, group_field, key_field, per_shard = self._args
        counts = (
            rows
            | "Group" >> beam.Map(lambda r: (r[group_field] if group_field else "", 1))
            | "Count" >> beam.CombinePerKey(sum)
        )
        return (
            rows
            | "AssignShard" >> beam.Map(_shard_path, AsDict(counts), prefix, group_field, key_field, per_shard)
            | "GroupShard" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(_WriteShard(self._schema, self._sort_fields, self._progress_dir))
        )


def _stage_events(stage: str):
    def events(row: Row) -> Iterator[tuple[tuple[str, str, str], int]]:
        yield (row["source"], stage, "docs_out"), 1
        yield (row["source"], stage, "bytes_out"), text_bytes(row)

    return events


def _reject_event(row: Row) -> tuple[tuple[str, str, str], int]:
    return (row["source"], row["stage"], f"rejected.{row['reason']}"), 1


def _write_stats(pairs: list[tuple[tuple[str, str, str], int]], path: str, config: CorpusConfig) -> str:
    stats = assemble_stats(pairs, config)
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as out:
        out.write(json.dumps(stats, indent=2, sort_keys=False).encode("utf-8") + b"\n")
    return path


# ---------------------------------------------------------------- the graph


def build_pipeline(p: beam.Pipeline, config: CorpusConfig, progress_dir: str | None = None) -> None:
    """Add the whole corpus build to `p` (inputs must already have passed `check_inputs`)."""
    out = config.output.directory.rstrip("/")
    sources = {s.name: s for s in config.sources}
    globs = [(s.name, g) for s in config.sources for g in s.inputs]

    read = (
        p
        | "Globs" >> beam.Create(globs)
        | "ExpandGlobs" >> beam.ParDo(ExpandInputs())
        | "SpreadFiles" >> beam.Reshuffle()
        | "Read" >> beam.ParDo(ReadFiles(sources, progress_dir)).with_outputs(REJECTS, main="docs")
    )
    docs = read.docs
    rejects = [read[REJECTS]]
    events = [docs | "ReadEvents" >> beam.FlatMap(_stage_events(READ_STAGE))]

    id_sources = frozenset(s.name for s in config.sources if s.fields.id is not None)
    if id_sources:
        docs, id_rejects = docs | "UniqueIds" >> UniqueIds(id_sources)
        rejects.append(id_rejects)

    filtered = docs | "Filter" >> beam.ParDo(FilterDocuments(config.filters, progress_dir)).with_outputs(REJECTS, main="docs")
    rejects.append(filtered[REJECTS])
    events.append(filtered.docs | "FilterEvents" >> beam.FlatMap(_stage_events("filter")))

    redacted = filtered.docs | "Redact" >> beam.ParDo(RedactDocuments(config.redaction, progress_dir)).with_outputs(STATS, main="docs")
    docs = redacted.docs
    events.append(redacted[STATS])

    clusters = []
    if config.dedup.exact:
        exact = docs | "ExactDedup" >> ExactDedup(config.dedup, progress_dir)
        docs = exact.docs
        rejects.append(exact[REJECTS])
        clusters.append(exact[CLUSTERS])
        events.append(exact[STATS])
        events.append(docs | "ExactEvents" >> beam.FlatMap(_stage_events("exact_dedup")))
    if config.dedup.near:
        docs, near_rejects, near_clusters, near_stats = docs | "NearDedup" >> NearDedup(config.dedup, progress_dir)
        rejects.append(near_rejects)
        clusters.append(near_clusters)
        events.append(near_stats)
    events.append(docs | "OutputEvents" >> beam.FlatMap(_stage_events("output")))

    all_rejects = rejects | "AllRejects" >> beam.Flatten()
    events.append(all_rejects | "RejectEvents" >> beam.Map(_reject_event))
    per_shard = config.output.rows_per_shard
    _ = docs | "WriteDocuments" >> WriteShards(
        f"{out}/documents", DOCUMENT_SCHEMA, "source", "id", ("id", "location"), per_shard, progress_dir
    )
    _ = all_rejects | "WriteRejects" >> WriteShards(
        f"{out}/rejects", REJECTED_SCHEMA, None, "location",
        ("source", "location", "stage", "reason", "document_id"), per_shard, progress_dir,
    )
    if clusters:
        _ = clusters | "AllClusters" >> beam.Flatten() | "WriteClusters" >> WriteShards(
            f"{out}/clusters", CLUSTER_SCHEMA, None, "document_id",
            ("cluster_id", "stage", "document_id", "location"), per_shard, progress_dir,
        )
    _ = (
        events
        | "AllEvents" >> beam.Flatten()
        | "SumEvents" >> beam.CombinePerKey(sum)
        | "CollectEvents" >> beam.combiners.ToList()
        | "WriteStats" >> beam.Map(_write_stats, f"{out}/{STATS_FILE}", config)
    )


def clear_outputs(directory: str) -> None:
    """Remove what a previous build wrote, so stale shards never mix with a rerun's."""
    directory = directory.rstrip("/")
    patterns = [f"{directory}/{d}/**" for d in OUTPUT_DIRS] + [f"{directory}/{STATS_FILE}", f"{directory}/report.md"]
    for result in FileSystems.match(patterns):
        paths = [m.path for m in result.metadata_list]
        if paths:
            FileSystems.delete(paths)


def run(config: CorpusConfig, options: PipelineOptions, progress_dir: str | None = None, wait: bool = True) -> str:
    """Submit the build; with `wait`, block until it ends. Returns the job state Beam reports."""
    clear_outputs(config.output.directory)
    p = beam.Pipeline(options=options)
    build_pipeline(p, config, progress_dir)
    result = p.run()
    return str(result.wait_until_finish() if wait else result.state)
