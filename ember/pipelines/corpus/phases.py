"""A local corpus build in two checkpointed phases, so an interrupted build resumes instead of starting over.

  documents  read -> unique ids -> filter -> redact; the surviving rows, the rejects so far and the
             summed stats events go to a cache entry beside the output, the rows' locations and the
             rejects' locations and details redacted as the one-graph build redacts them before writing:
             `<output parent>/.<output name>-ember-cache/documents-<key>/`
  output     exact + near dedup and the final write, from that entry, into the staged output.

Each phase is content-addressed: its key hashes the config sections it depends on and (for
`documents`) every input file's path, size and mtime_ns, so a changed filter or a touched input
invalidates exactly what depends on it. A cache entry is written under a temporary name, its marker
(`COMPLETE_FILE`, every file with size and sha256) written last, then renamed to its key; a rerun
reuses an entry only when the marker is there and every file still matches it. The `output` phase's
key is recorded in the output's ownership file: a rerun whose key matches skips the whole build.
A completed build removes every other cache entry of that output (superseded keys) and keeps the
current one, so a later change to dedup or output settings still skips `documents`.

The two phases run as two Beam jobs (`split`: an interruption in `output` resumes after `documents`) or
fused into one (`fused_pipeline`: the `documents` results are written to the entry on the side and flow on
into dedup, so a small build pays Beam's fixed cost once; an interrupted one starts over). Every graph
ends in the same `write_outputs` as the one-graph build (ember/pipelines/corpus/pipeline.py), fed the
same rows, so a fused, a split and a resumed build write byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from ember.pipelines.corpus.config import CorpusConfig
from ember.pipelines.corpus.outputs import WriteParquetParts, write_outputs
from ember.pipelines.corpus.pipeline import corpus_stages
from ember.pipelines.corpus.stages import (
    CLUSTER_TEXT_FIELDS, DEDUP_TRANSFORMS, REJECT_TEXT_FIELDS, RedactRows, SplitText, StageOutput,
)
from ember.pipelines.jobs.runners import run_pipeline
from ember.files import write_atomically
from ember.schemas.documents import DOCUMENT_SCHEMA, REJECTED_SCHEMA

PHASE_VERSION = 3  # bump when a phase's graph or cache layout changes: old entries then never match
COMPLETE_FILE = ".complete.json"
COMPLETE_SCHEMA = "ember.phase_cache"
EVENTS_FILE = "events.json"
CACHE_ROWS_PER_SHARD = 50_000
# Kept rows carry their location into dedup (representative order, cluster rows, rejects).
CACHED_DOCUMENT_SCHEMA = pa.schema([*DOCUMENT_SCHEMA, pa.field("location", pa.string(), nullable=False)])


def cache_root(target: Path) -> Path:
    return target.parent / f".{target.name}-ember-cache"


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def input_listing(config: CorpusConfig) -> list[list[Any]]:
    """Every matched input as [source, path, size, mtime_ns] (a remote file's update time where no mtime_ns)."""
    listing = []
    for source in config.sources:
        for pattern in source.inputs:
            for m in sorted(FileSystems.match([pattern])[0].metadata_list, key=lambda m: m.path):
                if "://" in m.path:
                    listing.append([source.name, m.path, m.size_in_bytes, m.last_updated_in_seconds])
                else:
                    st = os.stat(m.path)
                    listing.append([source.name, m.path, st.st_size, st.st_mtime_ns])
    return listing


def documents_key(config: CorpusConfig) -> str:
    """What the `documents` phase reads and decides with: sources, filters, redaction, and the inputs as they are now."""
    return _digest({
        "phase": "documents", "version": PHASE_VERSION,
        "sources": [s.model_dump(mode="json") for s in config.sources],
        "filters": config.filters.model_dump(mode="json"),
        "redaction": config.redaction.model_dump(mode="json"),
        "inputs": input_listing(config),
        "classifier_model": _file_identity(config.filters.classifier.model) if config.filters.classifier else None,
    })


def _file_identity(path: str) -> list[Any]:
    """A local file as [size, mtime_ns]: a retrained model at the same path makes the phase run again."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def output_key(config: CorpusConfig, documents: str) -> str:
    """The `output` phase: the documents it starts from, and every other setting (dedup, output, tokenize)."""
    settings = config.model_dump(mode="json", exclude={"sources", "filters", "redaction"})
    settings["output"].pop("directory")
    return _digest({"phase": "output", "version": PHASE_VERSION, "documents": documents, "settings": settings})


# ---------------------------------------------------------------- cache entries


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def seal(entry: Path) -> None:
    """The marker, written last: every file of the entry with its size and sha256."""
    files = {}
    for path in sorted(p for p in entry.rglob("*") if p.is_file() and p.name != COMPLETE_FILE):
        files[path.relative_to(entry).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    payload = {"schema": COMPLETE_SCHEMA, "version": PHASE_VERSION, "files": files}
    write_atomically(entry / COMPLETE_FILE, (json.dumps(payload, indent=1) + "\n").encode("utf-8"))


def verified(entry: Path) -> dict[str, Any] | None:
    """The entry's marker when the entry is complete and every file in it matches; None otherwise."""
    try:
        marker = json.loads((entry / COMPLETE_FILE).read_text(encoding="utf-8"))
        files = marker["files"]
        for name, expected in files.items():
            path = entry / name
            if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return marker if marker.get("schema") == COMPLETE_SCHEMA else None


def partial_entry(root: Path, name: str) -> Path:
    """A fresh directory for a phase's output, renamed to `root/name` by `publish_entry` once sealed."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.partial-"))


def publish_entry(partial: Path, entry: Path) -> None:
    seal(partial)
    if entry.exists():  # an entry that failed verification
        shutil.rmtree(entry)
    os.rename(partial, entry)


def prune(root: Path, keep: str) -> list[str]:
    """Removes every cache entry (and leftover partial) of this output except `keep`; returns what it removed."""
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


# ---------------------------------------------------------------- the graphs


def documents_stages(p: beam.Pipeline, config: CorpusConfig, progress_dir: str | None) -> StageOutput:
    """read .. redact, every kept row's location and every reject redacted as the cache entry holds them (no stage
    before dedup makes clusters, so the entry has none)."""
    documents, outputs = p, []
    for stage in corpus_stages(config, progress_dir):
        if isinstance(stage, DEDUP_TRANSFORMS):
            break
        output = documents | stage
        outputs.append(output)
        documents = output.documents
    rejects, clusters, stats = (
        [getattr(o, name) for o in outputs] | f"Found{name.title()}" >> beam.Flatten() for name in ("rejects", "clusters", "stats")
    )
    # a kept row's location becomes its cluster rows' and dedup rejects' location in the output phase
    documents = documents | "RedactLocations" >> RedactRows(config.redaction, CLUSTER_TEXT_FIELDS)
    rejects = rejects | "RedactRejects" >> RedactRows(config.redaction, REJECT_TEXT_FIELDS)
    return StageOutput(documents, rejects, clusters, stats)


def cache_documents(found: StageOutput, entry: str) -> None:
    """The `documents` phase's results into `entry`: documents/<source>/part-*.parquet, rejects/part-*.parquet, events.json."""
    _ = found.documents | "CacheDocuments" >> WriteParquetParts(
        f"{entry}/documents", CACHED_DOCUMENT_SCHEMA, "source", "id", ("id", "location"), CACHE_ROWS_PER_SHARD, None
    )
    _ = found.rejects | "CacheRejects" >> WriteParquetParts(
        f"{entry}/rejects", REJECTED_SCHEMA, None, "location", ("source", "location", "stage", "reason", "document_id"),
        CACHE_ROWS_PER_SHARD, None,
    )
    _ = (
        found.stats
        | "SumCachedEvents" >> beam.CombinePerKey(sum)
        | "CollectCachedEvents" >> beam.combiners.ToList()
        | "CacheEvents" >> beam.Map(_write_events, f"{entry}/{EVENTS_FILE}")
    )


def documents_pipeline(p: beam.Pipeline, config: CorpusConfig, entry: str, progress_dir: str | None) -> None:
    """The `documents` phase alone: read .. redact into `entry`."""
    cache_documents(documents_stages(p, config, progress_dir), entry)


def _write_events(events: list, path: str) -> None:
    write_atomically(Path(path), json.dumps(sorted([list(k), v] for k, v in events)).encode("utf-8"))


def _read_rows(path: str) -> Iterator[dict[str, Any]]:
    yield from pq.read_table(path).to_pylist()


def cached_documents(p: beam.Pipeline, entry: str, marker: dict[str, Any]) -> StageOutput:
    """What `cache_documents` wrote, read back from a verified entry."""
    def cached(kind: str) -> beam.PCollection:
        paths = sorted(f"{entry}/{name}" for name in marker["files"] if name.startswith(f"{kind}/"))
        return (
            p
            | f"{kind.title()}Files" >> beam.Create(paths)
            | f"Spread{kind.title()}" >> beam.Reshuffle()
            | f"Read{kind.title()}" >> beam.FlatMap(_read_rows)
        )

    events = json.loads(Path(entry, EVENTS_FILE).read_text(encoding="utf-8"))
    stats = p | "CachedEvents" >> beam.Create([(tuple(k), v) for k, v in events])
    return StageOutput(cached("documents"), cached("rejects"), p | "CachedClusters" >> beam.Create([]), stats)


def output_stages(p: beam.Pipeline, config: CorpusConfig, found: StageOutput, progress_dir: str | None) -> None:
    """exact + near dedup of the `documents` phase's results, and the write into `config.output.directory`."""
    documents, rejects, clusters, stats = found.documents, [found.rejects], [found.clusters], [found.stats]
    texts = None
    for stage in corpus_stages(config, progress_dir):
        if isinstance(stage, DEDUP_TRANSFORMS):
            if texts is None:
                documents, texts = documents | "SplitText" >> SplitText(config.dedup)
            output = documents | stage
            rejects.append(output.rejects)
            clusters.append(output.clusters)
            stats.append(output.stats)
            documents = output.documents
    flat = [parts | f"All{name}" >> beam.Flatten() for name, parts in (("Rejects", rejects), ("Clusters", clusters), ("Stats", stats))]
    write_outputs(StageOutput(documents, *flat), config, progress_dir, texts)


def output_pipeline(p: beam.Pipeline, config: CorpusConfig, entry: str, marker: dict[str, Any], progress_dir: str | None) -> None:
    """The `output` phase alone: dedup + write from a verified `documents` entry."""
    output_stages(p, config, cached_documents(p, entry, marker), progress_dir)


def fused_pipeline(p: beam.Pipeline, config: CorpusConfig, entry: str, progress_dir: str | None) -> None:
    """Both phases as one graph: the `documents` results go into `entry` on the side and straight on into dedup,
    so a small build pays Beam's fixed cost (runner, workers, graph) once. The rows dedup sees are the ones the
    cache holds, so the output is byte-identical to the two-job build's."""
    found = documents_stages(p, config, progress_dir)
    cache_documents(found, entry)
    # Beam 2.62's portable fuser (Flink) rejects a graph where a Flatten and another transform read the same
    # PCollection (apache/beam#34647): the rejects and stats the cache reads reach the output's Flattens as copies.
    copies = {name: getattr(found, name) | f"Output{name.title()}" >> beam.Map(lambda element: element)
              for name in ("rejects", "stats")}
    output_stages(p, config, found._replace(**copies), progress_dir)


def run_documents(config: CorpusConfig, args: list[str], entry: str, progress_dir: str | None) -> str:
    """The `documents` phase as one Beam job; returns its final state (module level: it may run in a child process)."""
    options = PipelineOptions(args)
    p = beam.Pipeline(options=options)
    documents_pipeline(p, config, entry, progress_dir)
    return run_pipeline(p, options, "phase documents")


def run_output(config: CorpusConfig, args: list[str], entry: str, marker: dict[str, Any], progress_dir: str | None) -> str:
    options = PipelineOptions(args)
    p = beam.Pipeline(options=options)
    output_pipeline(p, config, entry, marker, progress_dir)
    return run_pipeline(p, options, "phase output")


def run_fused(config: CorpusConfig, args: list[str], entry: str, progress_dir: str | None) -> str:
    options = PipelineOptions(args)
    p = beam.Pipeline(options=options)
    fused_pipeline(p, config, entry, progress_dir)
    return run_pipeline(p, options, "phases documents + output")
