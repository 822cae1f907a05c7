"""Near dedup across releases: a build saves its MinHash band keys as an index; a later build dedups against it.

A monthly refresh should not recompute the signatures of every document it released before. `dedup.index` saves
each (LSH band key, node) pair of the documents that entered near dedup - the node is the document's graph key,
representative order included (`stages.node_key`) - as Parquet under `<index>/bands/`, then `index.json` last, which
lists the parts and the MinHash settings the keys depend on: a location without it is not an index.

A build with `dedup.against: [index, ...]` groups its own band keys with the indexed ones, so its LSH buckets, edges
and connected components are those of one build over both releases, without reading or hashing the old documents.
Its verdicts differ in one way only: a component holding an indexed document has its representative in an earlier
release, so every new document in it is removed, counted as `near_duplicate_of_earlier_release` (stats.json
`dedup.near_dedup.earlier_release_removed`) apart from duplicates within this build. Indexed documents are never
removed: they are not in this build. Cluster ids are those the one build over both would give (the component root's
document id), so the clusters restricted to the new documents equal a full rebuild's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import pyarrow as pa

from ember import storage
from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import CorpusConfig, Dedup
from ember.pipelines.corpus.outputs import WriteParquetParts
from ember.pipelines.corpus.stages import (
    CLUSTERS, EARLIER_RELEASE_REASON, REJECTS, STATS, CorpusFn, NearDedup, ResolveCluster, StageOutput, node_document_id,
)
from ember.pipelines.jobs.output_guard import OutputUnusable

INDEX_FILE = "index.json"
INDEX_SCHEMA = "ember.minhash_index"
INDEX_VERSION = 1
BANDS = "bands"
BAND_SCHEMA = pa.schema([pa.field("key", pa.binary(), nullable=False), pa.field("node", pa.string(), nullable=False)])
MATCHED = ("shingle", "n_grams", "bands", "rows_per_band", "seed", "prefer", "permissive_licenses")
"""The settings a band key or a node depends on: an index built with others cannot be matched against."""


def index_settings(dedup: Dedup) -> dict[str, Any]:
    return {name: getattr(dedup, name) for name in MATCHED}


def read_index(location: str, where: str) -> dict[str, Any]:
    """An index's `index.json`; a location without one, or unreadable, is a CorpusConfigError naming `where`."""
    path = storage.join(location, INDEX_FILE)
    try:
        data = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise CorpusConfigError(f"{where}: {path} does not exist: {location} is not a finished MinHash index") from None
    except (storage.StorageError, ValueError) as exc:
        raise CorpusConfigError(f"{where}: {path} is not readable ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != INDEX_SCHEMA:
        raise CorpusConfigError(f"{where}: {path} is not an ember MinHash index ({INDEX_SCHEMA})")
    return data


def check_indexes(config: CorpusConfig) -> None:
    """Before any work: the index to save goes to a new or empty location, and each index to dedup against is finished
    and built with this build's MinHash settings (else its band keys could never match)."""
    dedup = config.dedup
    if dedup.index is not None:
        present = storage.list_files(dedup.index)
        if present:
            shown = ", ".join(sorted(present)[:3])
            raise OutputUnusable(f"dedup.index: {dedup.index} is not empty ({shown}); an index goes to a new location")
    ours = index_settings(dedup)
    for i, location in enumerate(dedup.against):
        theirs = read_index(location, f"dedup.against.{i}")["settings"]
        differ = [f"{name} {theirs.get(name)!r} (this build: {ours[name]!r})" for name in MATCHED if theirs.get(name) != ours[name]]
        if differ:
            raise CorpusConfigError(f"dedup.against.{i}: {location} was built with other MinHash settings: {'; '.join(differ)}")


def _band_row(element: tuple[bytes, str]) -> dict[str, Any]:
    return {"key": element[0], "node": element[1]}


def _write_index_file(parts: list[str], location: str, settings: dict[str, Any]) -> str:
    prefix = location.rstrip("/") + "/"
    listed = sorted(p[len(prefix):] if p.startswith(prefix) else p for p in parts)
    payload = {"schema": INDEX_SCHEMA, "version": INDEX_VERSION, "settings": settings, "parts": listed}
    return storage.write_bytes(storage.join(location, INDEX_FILE), (json.dumps(payload, indent=1) + "\n").encode())


class WriteIndex(beam.PTransform):
    """(band key, node) pairs -> `<location>/bands/part-*.parquet`, then `index.json` naming them, last."""

    def __init__(self, location: str, dedup: Dedup, rows_per_shard: int):
        super().__init__()
        self._location, self._dedup, self._per_shard = location, dedup, rows_per_shard

    def expand(self, keys):
        parts = (
            keys
            | "Rows" >> beam.Map(_band_row)
            | "Parts" >> WriteParquetParts(storage.join(self._location, BANDS), BAND_SCHEMA, None, "key",
                                           ("key", "node"), self._per_shard, None)
        )
        return (
            parts
            | "AllParts" >> beam.combiners.ToList()
            | "IndexFile" >> beam.Map(_write_index_file, self._location, index_settings(self._dedup))
        )


class ReadIndexes(beam.PTransform):
    """The indexes at `locations` -> their (band key, node) pairs, from exactly the parts each `index.json` lists."""

    def __init__(self, locations: list[str]):
        super().__init__()
        self._files = [
            storage.join(location, part)
            for i, location in enumerate(locations)
            for part in read_index(location, f"dedup.against.{i}")["parts"]
        ]

    def expand(self, pipeline):
        return (
            pipeline
            | "Parts" >> beam.Create(self._files)
            | "Read" >> beam.io.ReadAllFromParquet(columns=["key", "node"])
            | "Pairs" >> beam.Map(lambda row: (row["key"], row["node"]))
        )


def indexed_roots(element: tuple[str, dict[str, list]]) -> Iterator[tuple[str, None]]:
    """An indexed node joined with its component label -> the root of its component (itself when it is the root)."""
    node, sides = element
    if sides["indexed"]:
        yield (sides["parent"][0] if sides["parent"] else node), None


class RootOf(CorpusFn):
    """A new document joined with its label -> keyed by its component's root (itself when alone), with whether it is
    that root and the component's size. Every document goes on to the root join: one whose node is an indexed node
    (the same document, at the same place, in an earlier release) is alone in no component but still a duplicate."""

    STAGE = "near_dedup"

    def process(self, element: tuple[str, dict[str, list]]) -> Iterator[tuple[str, tuple[dict, bool, int]]]:
        node, sides = element
        parents, members = sides["parent"], sides["members"]
        for row in sides["doc"]:
            self.advance()
            if parents:
                yield parents[0], (row, False, 0)
            else:
                yield node, (row, True, sum(members) + 1)


class ResolveAgainst(ResolveCluster):
    """A component's new documents, and whether an indexed document is in it -> the verdicts: all removed as
    duplicates of an earlier release when one is, else the root kept as within any build. Progress was counted by
    `RootOf`."""

    STAGE = "near_dedup"
    REASON = "near_duplicate"

    def process(self, element: tuple[str, dict[str, list]]) -> Iterator[Any]:
        root, sides = element
        cluster_id = node_document_id(root)
        earlier = bool(sides["indexed"])
        for row, is_root, size in sides["rooted"]:
            if earlier:
                yield self.reject(row, EARLIER_RELEASE_REASON, f"cluster={cluster_id}")
                yield self.cluster(row, cluster_id, False)
            elif is_root:
                if size > 1:
                    yield from self.representative(row, size)
                yield row
            else:
                yield from self.duplicate(row, cluster_id)


class IncrementalNearDedup(NearDedup):
    """`NearDedup` that saves its band keys as an index (`dedup.index`) and/or dedups against earlier releases'
    indexes (`dedup.against`)."""

    def __init__(self, dedup: Dedup, progress_dir: str | None, rows_per_shard: int):
        super().__init__(dedup, progress_dir)
        self._rows_per_shard = rows_per_shard
        self._indexed = None

    def bands(self, keys):
        dedup = self._dedup
        if dedup.index is not None:
            _ = keys | "SaveIndex" >> WriteIndex(dedup.index, dedup, self._rows_per_shard)
        if not dedup.against:
            return keys
        indexed = keys.pipeline | "ReadIndexes" >> ReadIndexes(dedup.against)
        self._indexed = indexed | "IndexedNodes" >> beam.Map(lambda pair: (pair[1], None))
        return (keys, indexed) | "WithIndexed" >> beam.Flatten()

    def resolve(self, joined, labels) -> StageOutput:
        if self._indexed is None:
            return super().resolve(joined, labels)
        roots = (
            {"indexed": self._indexed, "parent": labels}
            | "JoinIndexed" >> beam.CoGroupByKey()
            | "IndexedRoots" >> beam.FlatMap(indexed_roots)
        )
        rooted = joined | "RootOf" >> beam.ParDo(RootOf(self._progress_dir))
        resolved = (
            {"rooted": rooted, "indexed": roots}
            | "JoinRoots" >> beam.CoGroupByKey()
            | "ResolveAgainst" >> beam.ParDo(ResolveAgainst()).with_outputs(REJECTS, CLUSTERS, STATS, main="docs")
        )
        return StageOutput(resolved.docs, resolved[REJECTS], resolved[CLUSTERS], resolved[STATS])


def near_dedup_stage(config: CorpusConfig, progress_dir: str | None) -> NearDedup:
    """The near-dedup stage `config.dedup` asks for: incremental only with an index to save or dedup against, so a
    plain build's graph is unchanged."""
    dedup = config.dedup
    if dedup.index is None and not dedup.against:
        return NearDedup(dedup, progress_dir)
    return IncrementalNearDedup(dedup, progress_dir, config.output.rows_per_shard)

