"""What a corpus build writes under `output.directory`, from the stages' flattened `StageOutput`:

  documents/<source>/part-SSSSS-of-NNNNN.parquet  kept rows (DOCUMENT_SCHEMA), zstd, sorted by id
  rejects/part-...parquet                         REJECTED_SCHEMA, sorted by (source, location, stage)
  clusters/part-...parquet                        CLUSTER_SCHEMA: every member of every duplicate cluster
  stats.json                                      per-source, per-stage counts (see `assemble_stats`)

Shard assignment hashes the row key and shard counts follow the row counts, so a rerun on the same
input writes byte-identical files on any runner. The job writes only into an empty or new directory
and never deletes anything; `build_corpus` stages local rebuilds (ember/pipelines/jobs/output_guard.py).
On a local disk each file appears under its final name only complete (temporary name + rename);
object stores publish an object only when its upload completes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import AsDict

from ember.pipelines.corpus.config import CorpusConfig
from ember.pipelines.corpus.formats import READ_STAGE, Row, write_parquet
from ember.pipelines.corpus.stages import (
    ALL_SOURCES, EARLIER_RELEASE_REASON, CorpusFn, Event, StageOutput, decompress_text, document_events,
)
from ember.pipelines.jobs.output_guard import SHOWN_FOREIGN, OutputUnusable, is_local
from ember.schemas.documents import CLUSTER_SCHEMA, DOCUMENT_SCHEMA, REJECTED_SCHEMA, STATS_FILE

STATS_SCHEMA = "ember.corpus_stats"
STATS_VERSION = 1
DEDUP_STAGES = ("exact_dedup", "near_dedup")


def publish(path: str, write: Callable[[str], None]) -> None:
    """`write(p)` creates the file at p; on a local disk p is a hidden temporary renamed to `path` once
    complete, and removed if writing fails (a full disk), so no truncated file ever has a final name."""
    if not is_local(path):
        write(path)
        return
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stable_shard(key: str, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little") % shards


class WriteParquetPart(CorpusFn):
    """(path, rows) -> that one Parquet file, its rows sorted by `sort_fields`."""

    STAGE = "write"

    def __init__(self, schema: pa.Schema, sort_fields: tuple[str, ...], progress_dir: str | None):
        super().__init__(progress_dir)
        self._schema = schema
        self._sort_fields = sort_fields

    def process(self, element: tuple[str, Iterable[Row]]) -> Iterator[str]:
        path, rows = element
        yield from self.write(path, rows, lambda row: row)

    def write(self, path: str, rows: Iterable[Row], complete: Callable[[Row], Row]) -> Iterator[str]:
        """`rows` sorted, each passed through `complete` as the file is written (one row group at a time)."""
        ordered = sorted(rows, key=lambda r: tuple(r.get(f) or "" for f in self._sort_fields))
        publish(path, lambda p: write_parquet(p, map(complete, ordered), self._schema))
        self.advance(len(ordered))
        yield path


def _text_key(row: Row) -> tuple[str, str]:
    return row["id"], row["location"]


class WriteJoinedPart(WriteParquetPart):
    """(path, {rows, texts}) -> that one Parquet file of dedup rows with their texts joined back (`SplitText`),
    each text decompressed only as its row group is written. The texts of the documents dedup removed share the
    shuffle and are dropped here; a path with no kept row (only removed documents' texts) writes nothing."""

    def process(self, element: tuple[str, dict[str, list]]) -> Iterator[str]:
        path, sides = element
        if not sides["rows"]:
            return
        texts: dict[tuple[str, str], list[Row]] = {}
        for text in sides["texts"]:
            texts.setdefault(_text_key(text), []).append(text)
        yield from self.write(path, sides["rows"], lambda row: {**row, "text": decompress_text(texts[_text_key(row)].pop())})


def _shard_path(row: Row, counts: dict[str, int], prefix: str, group_field: str | None, key_field: str, per_shard: int) -> tuple[str, Row]:
    group = row[group_field] if group_field else ""
    shards = max(1, math.ceil(counts[group] / per_shard))
    shard = stable_shard(f"{row[key_field]}\x00{row.get('location', '')}", shards)
    folder = f"{prefix}/{group}" if group_field else prefix
    return f"{folder}/part-{shard:05d}-of-{shards:05d}.parquet", row


def _text_shard_path(text: Row, counts: dict[str, int], prefix: str, group_field: str | None, key_field: str,
                     per_shard: int) -> Iterator[tuple[str, Row]]:
    """A text to the part its row would go to; none where its group kept no row (counts has no entry)."""
    if (text[group_field] if group_field else "") in counts:
        yield _shard_path(text, counts, prefix, group_field, key_field, per_shard)


class WriteParquetParts(beam.PTransform):
    """Rows -> `prefix[/group]/part-SSSSS-of-NNNNN.parquet`, shard count from the group's row count. With `texts`
    (`SplitText`'s), the rows are dedup rows and each part joins its rows with their texts before writing."""

    def __init__(self, prefix: str, schema: pa.Schema, group_field: str | None, key_field: str,
                 sort_fields: tuple[str, ...], rows_per_shard: int, progress_dir: str | None, texts=None):
        super().__init__()
        self._args = (prefix, group_field, key_field, rows_per_shard)
        self._texts = texts
        fn = WriteParquetPart if texts is None else WriteJoinedPart
        self._fn = fn(schema, sort_fields, progress_dir)

    def expand(self, rows):
        prefix, group_field, key_field, per_shard = self._args
        counts = (
            rows
            | "Group" >> beam.Map(lambda r: (r[group_field] if group_field else "", 1))
            | "Count" >> beam.CombinePerKey(sum)
        )
        keyed = rows | "AssignShard" >> beam.Map(_shard_path, AsDict(counts), prefix, group_field, key_field, per_shard)
        if self._texts is None:
            return keyed | "GroupShard" >> beam.GroupByKey() | "Write" >> beam.ParDo(self._fn)
        texts = self._texts | "AssignTextShard" >> beam.FlatMap(
            _text_shard_path, AsDict(counts), prefix, group_field, key_field, per_shard)
        return {"rows": keyed, "texts": texts} | "JoinShard" >> beam.CoGroupByKey() | "Write" >> beam.ParDo(self._fn)


def _empty_stats(config: CorpusConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    sources = {
        s.name: {"kind": s.kind, "weight": s.weight, "docs_in": 0, "bytes_in": 0, "kept": 0, "bytes_kept": 0,
                 "stages": {}, "rejected": {}, "redactions": {}}
        for s in config.sources
    }
    dedup = {stage: {"clusters": 0, "removed": 0, "cluster_sizes": {}} for stage in DEDUP_STAGES}
    dedup["near_dedup"].update(cc_max_rounds=config.dedup.max_cc_rounds, cc_unconverged_edges=0,
                               jaccard_threshold=round(config.dedup.threshold, 4))
    if config.dedup.against:
        dedup["near_dedup"]["earlier_release_removed"] = 0  # apart from `removed`, the duplicates within this build
    return sources, dedup


def _add_event(sources: dict[str, Any], dedup: dict[str, Any], key: tuple[str, str, str], value: int) -> None:
    source, stage, metric = key
    if source == ALL_SOURCES:
        if metric.startswith("cluster_size."):
            dedup[stage]["cluster_sizes"][metric.split(".", 1)[1]] = value
        else:
            dedup[stage][metric] = value
        return
    entry = sources[source]
    if metric.startswith("rejected."):
        reason = metric.split(".", 1)[1]
        entry["stages"].setdefault(stage, {}).setdefault("rejected", {})[reason] = value
        entry["rejected"][f"{stage}:{reason}"] = value
        entry["docs_in"] += value if stage == READ_STAGE else 0
        if stage in dedup:
            dedup[stage]["earlier_release_removed" if reason == EARLIER_RELEASE_REASON else "removed"] += value
    elif metric.startswith("redactions."):
        entry["redactions"][metric.split(".", 1)[1]] = value
    else:
        entry["stages"].setdefault(stage, {})[metric] = value


def _finish_source(entry: dict[str, Any]) -> None:
    read = entry["stages"].get(READ_STAGE, {})
    entry["docs_in"] += read.get("docs_out", 0)
    entry["bytes_in"] = read.get("bytes_out", 0)
    final = entry["stages"].get("output", {})
    entry["kept"] = final.get("docs_out", 0)
    entry["bytes_kept"] = final.get("bytes_out", 0)
    entry["rejected_total"] = sum(entry["rejected"].values())
    entry["balanced"] = entry["docs_in"] == entry["kept"] + entry["rejected_total"]


def _totals(sources: dict[str, Any]) -> dict[str, Any]:
    rejected_by_reason: dict[str, int] = {}
    redactions: dict[str, int] = {}
    for entry in sources.values():
        for reason, n in entry["rejected"].items():
            rejected_by_reason[reason] = rejected_by_reason.get(reason, 0) + n
        for kind, n in entry["redactions"].items():
            redactions[kind] = redactions.get(kind, 0) + n
    totals = {
        "docs_in": sum(e["docs_in"] for e in sources.values()),
        "bytes_in": sum(e["bytes_in"] for e in sources.values()),
        "kept": sum(e["kept"] for e in sources.values()),
        "bytes_kept": sum(e["bytes_kept"] for e in sources.values()),
        "rejected": sum(e["rejected_total"] for e in sources.values()),
        "rejected_by_reason": dict(sorted(rejected_by_reason.items())),
        "redactions": redactions,
    }
    totals["balanced"] = totals["docs_in"] == totals["kept"] + totals["rejected"]
    return totals


def assemble_stats(pairs: Iterable[Event], config: CorpusConfig) -> dict[str, Any]:
    """stats.json from summed ((source, stage, metric), value) events: per source, per stage, and totals."""
    sources, dedup = _empty_stats(config)
    for key, value in sorted(pairs):
        _add_event(sources, dedup, key, value)
    for entry in sources.values():
        _finish_source(entry)
    for stage in dedup.values():
        stage["cluster_sizes"] = dict(sorted(stage["cluster_sizes"].items(), key=lambda kv: int(kv[0].split("-")[0])))
    return {"schema": STATS_SCHEMA, "version": STATS_VERSION, "totals": _totals(sources), "sources": sources, "dedup": dedup}


def _reject_event(row: Row) -> Event:
    return (row["source"], row["stage"], f"rejected.{row['reason']}"), 1


def _write_stats(pairs: list[Event], path: str, config: CorpusConfig) -> str:
    data = json.dumps(assemble_stats(pairs, config), indent=2, sort_keys=False).encode("utf-8") + b"\n"

    def write(p: str) -> None:
        with FileSystems.create(p, compression_type=CompressionTypes.UNCOMPRESSED) as out:
            out.write(data)

    publish(path, write)
    return path


def write_outputs(outputs: StageOutput, config: CorpusConfig, progress_dir: str | None, texts=None) -> None:
    """The three Parquet outputs and stats.json; kept documents count as stage `output`, rejects by reason. With
    `texts`, the documents are dedup rows (`stages.SplitText`), joined with their texts in the write."""
    out = config.output.directory.rstrip("/")
    per_shard = config.output.rows_per_shard
    _ = outputs.documents | "WriteDocuments" >> WriteParquetParts(
        f"{out}/documents", DOCUMENT_SCHEMA, "source", "id", ("id", "location"), per_shard, progress_dir, texts
    )
    _ = outputs.rejects | "WriteRejects" >> WriteParquetParts(
        f"{out}/rejects", REJECTED_SCHEMA, None, "location",
        ("source", "location", "stage", "reason", "document_id"), per_shard, progress_dir,
    )
    _ = outputs.clusters | "WriteClusters" >> WriteParquetParts(
        f"{out}/clusters", CLUSTER_SCHEMA, None, "document_id",
        ("cluster_id", "stage", "document_id", "location"), per_shard, progress_dir,
    )
    events = (
        outputs.stats,
        outputs.documents | "OutputEvents" >> beam.FlatMap(document_events, "output"),
        outputs.rejects | "RejectEvents" >> beam.Map(_reject_event),
    )
    _ = (
        events
        | "AllEvents" >> beam.Flatten()
        | "SumEvents" >> beam.CombinePerKey(sum)
        | "CollectEvents" >> beam.combiners.ToList()
        | "WriteStats" >> beam.Map(_write_stats, f"{out}/{STATS_FILE}", config)
    )


def require_empty_output(directory: str) -> None:
    """The job never overwrites or deletes: an output directory that holds anything is refused before it starts."""
    present = FileSystems.match([f"{directory.rstrip('/')}/**"], limits=[SHOWN_FOREIGN])[0].metadata_list
    if present:
        shown = ", ".join(m.path for m in present)
        raise OutputUnusable(
            f"output.directory {directory} is not empty ({shown}); the Beam job writes only into an empty or new "
            "directory and deletes nothing. Choose a new output path (`ember corpus build` replaces a local build of "
            "its own safely)."
        )
