"""Beam pipeline: deduplicated `Document` Parquet -> tokenized, best-fit packed, shuffled Arrow shards.

Stages (each a Beam transform, so the same graph runs on FnApiRunner, Flink or Dataflow):
  1. per source: read Parquet row groups, batch-encode in a DoFn (tokenizer loaded once in `setup`,
     or taken from the driver when the runner works in its process); documents empty after
     tokenization become counted rejects. Each tokenizer call's documents leave as one batch
     (ember/tokenize/batches.py): their tokens in one buffer and, separately, their ids and lengths.
  2. count documents per source -> number of packing windows; each document's *length* goes to a
     window chosen by a seeded hash of its id (one element per batch and window); GroupByKey per
     (source, window) and pack there, so a window holds lengths only, and mixture sources never share
     a sequence. A window's placements go back to the batches their documents came in, one element per
     batch and window.
  3. join each batch's tokens with its placements (one GroupByKey on the batch over both, tagged) and
     send each piece to the shard its sequence lands in: global index from the per-window bin counts,
     then a seeded Feistel permutation -> (shard, row), one element per batch and shard. No worker ever
     holds more than one shard's tokens.
  4. each shard written by its worker, atomically, then - last - the manifest with per-shard sha256 and exact
     per-source token/padding accounting.
Code mid-training options (docs/guides/code-data.md), each recorded in the manifest: `repositories` turns a
source's files into one document per repository before step 1 (ember/pipelines/code/documents.py); `fim`
rearranges a document's tokens in step 1 (ember/tokenize/fim.py); `mixture` gives each document its seeded number
of copies in step 2, each packed as a document of its own (ember/tokenize/mixtures.py).
The graph is kept to few transforms: Beam's fixed cost (graph construction, bundle set-up) is paid per
transform, and on a small build it is most of the run (bench/bench_tokenize_pack.py).
`run` writes the set into a fresh staging directory next to `output_dir` and swaps it in once the
manifest is written (ember/pipelines/jobs/output_guard.py): a failed run leaves the previous set intact,
and files the previous manifest does not list are never deleted. For a gs:// or s3:// `output_dir` the workers
write every file there themselves, the manifest last, and a replaced set is switched in one write
(`write_to_url`, ember/pipelines/jobs/set_commit.py); a local `output_dir` with workers that do not share this
machine's disk is refused before any work.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import tempfile
import threading
import uuid
import weakref
from dataclasses import asdict, astuple, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions
from rich.console import Console

from ember import storage
from ember.configs import TokenizeConfigError
from ember.files import write_atomically
from ember.pipelines.jobs.process import isolating, run_job
from ember.pipelines.jobs.output_guard import MIN_FREE_BYTES, OutputUnusable, check_room, refuse_foreign, staged
from ember.pipelines.jobs.progress import ProgressWriter, watch
from ember.pipelines.jobs import set_commit
from ember.pipelines.jobs.runners import run_pipeline, runs_locally
from ember.schemas import SchemaValidationError
from ember.schemas.documents import REJECTED_SCHEMA, reject_row
from ember.schemas.shards import MANIFEST_FILENAME, Manifest, parse_manifest, read_manifest
from ember.tokenize import fim, mixtures
from ember.tokenize.batches import PLACEMENTS, TOKEN_BYTES, TOKENS, joined, token_batch
from ember.tokenize.config import FimSettings, ShardSource, TokenizeConfig, TokenizerConfig
from ember.tokenize.packing import Segment, assemble, pack, window_count, window_of
from ember.tokenize.shards import ShardRow, encode_shard, shard_name
from ember.tokenize.shuffle import FeistelPermutation
from ember.tokenize.tokenizers import Tokenizer, load_tokenizer

STAGE = "tokenize"
REQUIRED_COLUMNS = ("id", "source", "text")
REJECTED_FILE = "rejected.parquet"
DEFAULT_RUNNER = "--runner=FnApiRunner"
SHARDS_PER_PARQUET_BYTE = 3  # zstd Parquet text is ~3x smaller than its zstd uint32 tokens, roughly
REJECTS = "rejects"  # the tagged output of reject rows, keyed by REJECTS_KEY
REJECTS_KEY = 0  # every reject row goes to the one rejected.parquet writer
REJECT_ROWS_PER_GROUP = 65536

_DRIVER_TOKENIZERS: weakref.WeakValueDictionary[str, Tokenizer] = weakref.WeakValueDictionary()
"""The tokenizer the driver loaded, by graph: a DoFn in the driver's process (FnApiRunner's in-process
worker) uses it instead of parsing the tokenizer file again; worker processes load their own. Entries
go when the driver drops its tokenizer."""


def driver_or_loaded(driver_tokenizer: str | None, config: TokenizerConfig) -> Tokenizer:
    """The driver's tokenizer when this worker runs in the driver's process, else one loaded here."""
    shared = _DRIVER_TOKENIZERS.get(driver_tokenizer or "")
    return shared if shared is not None and shared.config == config else load_tokenizer(config)


def _keyed_reject(row: dict) -> beam.pvalue.TaggedOutput:
    return beam.pvalue.TaggedOutput(REJECTS, (REJECTS_KEY, row))


class TokenizeDocuments(beam.DoFn):
    """Row groups in; per tokenizer call one batch, (key, (TOKENS, (ids, lengths, token bytes))), out, its
    (source, key, ids, lengths) and the rejects on tagged outputs (ember/tokenize/batches.py)."""

    LENGTHS = "lengths"

    def __init__(self, tokenizer: TokenizerConfig, source: ShardSource, location: str, batch_documents: int,
                 progress_dir: str | None = None, driver_tokenizer: str | None = None, fim_settings: FimSettings | None = None):
        self._progress_dir = progress_dir
        self._fim = fim_settings
        self._driver_tokenizer = driver_tokenizer
        self._tokenizer_config = tokenizer
        self._source = source
        self._location = location
        self._batch = batch_documents
        self._documents = Metrics.counter(STAGE, f"{source.name}.documents")
        self._tokens = Metrics.counter(STAGE, f"{source.name}.tokens")
        self._rejected = Metrics.counter(STAGE, f"{source.name}.rejected")

    def setup(self) -> None:
        self._tok = driver_or_loaded(self._driver_tokenizer, self._tokenizer_config)
        self._progress = ProgressWriter(self._progress_dir)
        self._fim_ids = fim.resolve_ids(self._fim, self._tok) if self._fim is not None else None
        self._framing = (int(self._tok.bos_id is not None), int(self._tok.eos_id is not None))

    def finish_bundle(self) -> None:
        self._progress.flush()

    def _reject(self, document_id: str | None, reason: str, detail: str = "") -> beam.pvalue.TaggedOutput:
        self._rejected.inc()
        return _keyed_reject(reject_row(self._source.name, self._location, STAGE, reason, detail, document_id))

    def process(self, table):
        name = self._source.name
        for start in range(0, table.num_rows, self._batch):
            chunk = table.slice(start, self._batch)
            ids, sources, texts = (chunk.column(c).to_pylist() for c in REQUIRED_COLUMNS)
            keep: list[int] = []
            for i, (doc_id, source, text) in enumerate(zip(ids, sources, texts)):
                if not doc_id:
                    yield self._reject(None, "missing_id")
                elif text is None:
                    yield self._reject(doc_id, "missing_text")
                elif source != name:
                    yield self._reject(doc_id, "source_mismatch", f"row source '{source}', configured '{name}'")
                else:
                    keep.append(i)
            lengths, data = self._encode([texts[i] for i in keep], [ids[i] for i in keep])
            self._progress.add(STAGE, chunk.num_rows)
            names, sizes = [], []
            for i, length in zip(keep, lengths):
                if length == 0:
                    yield self._reject(ids[i], "empty_after_tokenization", f"{len(texts[i])} characters")
                else:
                    names.append(ids[i])
                    sizes.append(length)
            if names:
                self._documents.inc(len(names))
                self._tokens.inc(len(data) // TOKEN_BYTES)
                tokens, lengths_element = token_batch(name, names, sizes, data)
                yield tokens
                yield beam.pvalue.TaggedOutput(self.LENGTHS, lengths_element)

    def _encode(self, texts: list[str], ids: list[str]) -> tuple[list[int], bytes]:
        """Each text's token count (0: empty after tokenization) and the tokens of the others in one buffer."""
        if self._fim_ids is None:
            return self._tok.encode_concatenated(texts)
        encoded = self._tok.encode_batch(texts)
        arrays = [fim.framed(self._fim, tokens, doc_id, *self._framing, self._fim_ids)
                  for doc_id, tokens, content in zip(ids, encoded.tokens, encoded.content_lengths) if content]
        lengths = iter(len(a) for a in arrays)
        return [next(lengths) if content else 0 for content in encoded.content_lengths], joined(arrays)


@dataclass(frozen=True)
class WindowStats:
    documents: int = 0
    tokens: int = 0
    sequences: int = 0
    padding_tokens: int = 0
    split_documents: int = 0

    def __add__(self, other: "WindowStats") -> "WindowStats":
        return WindowStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


class PackWindow(beam.DoFn):
    """One packing window's documents in, as (id, length, batch key, index in the batch), one list per batch; per
    batch its documents' placements, one per piece, and the copies dropped as duplicates out, plus the window's bin
    count and stats."""

    WINDOWS = "windows"

    def __init__(self, seq_len: int, strategy: str, sources: dict[str, str]):
        self._seq_len = seq_len
        self._strategy = strategy
        self._source_paths = sources

    def process(self, element):
        (source, window), groups = element
        kept: list[list[tuple]] = []  # per document id, its copies of the fewest tokens
        by_batch: dict[str, tuple[list, list]] = {}  # batch key -> (placements, dropped indices)
        # A repeated id means an upstream dedup bug; keep one copy: the one with the fewest tokens, and of several
        # such the one whose tokens sort first, which only the shard writer, holding their tokens, can tell.
        for doc_id, group in itertools.groupby(sorted(itertools.chain.from_iterable(groups)), key=lambda d: d[0]):
            copies = list(group)
            shortest = [c for c in copies if c[1] == copies[0][1]]
            kept.append(shortest)
            for _name, _length, key, index in copies[len(shortest):]:
                by_batch.setdefault(key, ([], []))[1].append(index)
            for _duplicate in copies[1:]:
                yield _keyed_reject(reject_row(source, self._source_paths[source], STAGE, "duplicate_document_id", "", doc_id))
        packing = pack([copies[0][1] for copies in kept], self._seq_len, self._strategy)
        for bin_index, pieces in enumerate(packing.bins):
            for slot, piece in enumerate(pieces):
                copies = kept[piece.doc]
                for name, _length, key, index in copies:
                    by_batch.setdefault(key, ([], []))[0].append(
                        (index, bin_index, slot, piece.start, piece.end, name, len(copies) > 1))
        for key, (placed, dropped) in by_batch.items():
            yield key, (PLACEMENTS, (source, window, placed, dropped))
        stats = WindowStats(len(kept), packing.tokens, len(packing.bins), packing.padding_tokens, packing.split_documents)
        yield beam.pvalue.TaggedOutput(self.WINDOWS, ((source, window), stats))


def assign_windows(element, counts: dict[str, int], window_documents: int, seed: int, plans: dict | None = None,
                   mixture_seed: int = 0):
    """A batch's (source, key, ids, lengths) -> ((source, window), [(id, length, key, index), ...]) per window it has
    documents in; each document once per copy the mixture `plans` give it (the copies go to windows of their own)."""
    source, key, names, lengths = element
    windows = window_count(counts[source], window_documents)
    by_window: dict[int, list] = {}
    for index, (doc_id, length) in enumerate(zip(names, lengths)):
        n = mixtures.copies(plans[source], doc_id, mixture_seed) if plans is not None else 1
        for k in range(n):
            name = mixtures.copy_id(doc_id, k)
            by_window.setdefault(window_of(name, windows, seed), []).append((name, length, key, index))
    for window, documents in by_window.items():
        yield (source, window), documents


def mixture_plans(token_sums: list[tuple[str, int]], config: TokenizeConfig) -> dict[str, mixtures.SourcePlan]:
    assert config.mixture is not None
    available = {s.name: 0 for s in config.sources} | dict(token_sums)
    return mixtures.plan(available, {s.name: s.weight for s in config.sources}, config.mixture.budgets,
                         config.mixture.total_tokens)


def window_layout(windows: list[tuple[tuple[str, int], WindowStats]], sampled: bool = False) -> dict:
    """Dense global index of each window's first bin, in (source, window) order, the total, and the
    stats summed per source; `sampled` when a mixture may leave documents out."""
    offsets: dict[tuple[str, int], int] = {}
    stats: dict[str, WindowStats] = {}
    total = 0
    for key, window in sorted(windows, key=lambda w: w[0]):
        offsets[key] = total
        total += window.sequences
        stats[key[0]] = stats.get(key[0], WindowStats()) + window
    return {"offsets": offsets, "total": total, "stats": stats, "sampled": sampled}


class RoutePieces(beam.DoFn):
    """A batch's tokens + its placements in; its pieces out, one list per shard their sequences land in:
    (row, slot, source, name, start, end, tokens, rank). `rank` is empty but for a copy of a duplicated id that
    ties for the fewest tokens: its whole tokens, by which the shard writer keeps one."""

    def __init__(self, seed: int, sequences_per_shard: int):
        self._seed = seed
        self._per_shard = sequences_per_shard
        self._permutation: FeistelPermutation | None = None

    def process(self, element, layout: dict):
        key, grouped = element
        batches, placements = [], []
        for kind, value in grouped:
            if kind == TOKENS:
                batches.append(value)
            else:
                placements.append(value)
        if len(batches) != 1:
            raise RuntimeError(f"batch {key} has {len(batches)} token copies and {len(placements)} placement lists")
        names, lengths, data = batches[0]
        starts = [0, *itertools.accumulate(lengths)]
        if self._permutation is None or self._permutation.n != layout["total"]:
            self._permutation = FeistelPermutation(layout["total"], self._seed)
        covered = bytearray(len(names))  # placed, or dropped as a duplicate
        by_shard: dict[int, list] = {}
        for source, window, pieces, gone in placements:
            for index in gone:
                covered[index] = 1
            first = layout["offsets"][(source, window)]
            for index, bin_index, slot, start, end, name, tied in pieces:
                covered[index] = 1
                shard, row = divmod(self._permutation(first + bin_index), self._per_shard)
                at = starts[index] * TOKEN_BYTES
                rank = data[at : starts[index + 1] * TOKEN_BYTES] if tied else b""
                by_shard.setdefault(shard, []).append(
                    (row, slot, source, name, start, end, data[at + start * TOKEN_BYTES : at + end * TOKEN_BYTES], rank))
        unplaced = covered.count(0)
        if unplaced and not layout.get("sampled"):  # a mixture may draw no copy of some
            raise RuntimeError(f"batch {key}: {unplaced} of its {len(names)} documents have no placement")
        yield from by_shard.items()


class WriteShard(beam.DoFn):
    """All pieces of one shard in (lists of them); the shard file written by this worker straight to the set's
    location, under the shard's own name (a retried bundle overwrites it); its `ShardEntry`, sha256 of the bytes
    written, out."""

    def __init__(self, output_dir: str, seq_len: int, pad_id: int, rows_per_batch: int, per_shard: int, prefix: str = ""):
        self._output_dir = output_dir
        self._prefix = prefix
        self._seq_len = seq_len
        self._pad_id = pad_id
        self._rows_per_batch = rows_per_batch
        self._per_shard = per_shard

    def process(self, element):
        shard, lists = element
        by_row: dict[int, dict[int, tuple]] = {}
        for piece in itertools.chain.from_iterable(lists):
            slots = by_row.setdefault(piece[0], {})
            held = slots.get(piece[1])
            if held is None or piece[7] < held[7]:
                slots[piece[1]] = piece
            if held is not None and not (piece[7] and held[7]):  # only tied copies of one document share a slot
                raise RuntimeError(f"shard {shard} row {piece[0]} slot {piece[1]} holds {held[3]} and {piece[3]}")
        if sorted(by_row) != list(range(len(by_row))):
            raise RuntimeError(f"shard {shard} rows are not contiguous from 0: {sorted(by_row)[:10]}")
        rows = []
        for index in range(len(by_row)):
            parts = [slot for _, slot in sorted(by_row[index].items())]
            segments = [Segment(p[3], p[4], p[5], np.frombuffer(p[6], dtype="<u4")) for p in parts]
            rows.append(ShardRow(assemble(segments, self._seq_len, self._pad_id), parts[0][2]))
        data = encode_shard(rows, self._rows_per_batch)
        written = set_commit.write_file(self._output_dir, set_commit.relative(self._prefix, shard_name(shard)), data)
        yield {"index": shard, "rows": len(rows), **written}


def encode_rejects(rows: Iterable[dict]) -> tuple[bytes, dict[tuple[str, str], int]]:
    """rejected.parquet's bytes (row groups as the rows stream in; an empty table when there are none) and the count
    per (source, reason)."""
    counts: dict[tuple[str, str], int] = {}
    buffer = pa.BufferOutputStream()
    with pq.ParquetWriter(buffer, REJECTED_SCHEMA) as writer:
        for group in itertools.batched(rows, REJECT_ROWS_PER_GROUP):
            writer.write_table(pa.Table.from_pylist(list(group), schema=REJECTED_SCHEMA))
            for row in group:
                key = (row["source"], row["reason"])
                counts[key] = counts.get(key, 0) + 1
    return buffer.getvalue().to_pybytes(), counts


def write_rejects(path: Path, rows: Iterable[dict]) -> dict[tuple[str, str], int]:
    """rejected.parquet at a local `path`, atomically, and the count per (source, reason)."""
    data, counts = encode_rejects(rows)
    write_atomically(path, data)
    return counts


class WriteRejects(beam.DoFn):
    """Every reject row in (one key); rejected.parquet written by this worker to the set's location;
    ((source, reason), count) out."""

    def __init__(self, output_dir: str, prefix: str = ""):
        self._output_dir = output_dir
        self._name = set_commit.relative(prefix, REJECTED_FILE)

    def process(self, element):
        _, rows = element
        data, counts = encode_rejects(rows)
        set_commit.write_file(self._output_dir, self._name, data)
        yield from counts.items()


def _finish(
    _,
    *,
    config: TokenizeConfig,
    tokenizer: dict,
    framing: dict,
    pad_id: int,
    dtype: str,
    config_hash: str,
    provenance: dict,
    shards: list[dict],
    layout: dict,
    rejected: list,
    prefix: str = "",
    plans: dict | None = None,
) -> str:
    """The last step: gathers the accounting, checks that every shard the workers reported is at the set's location
    at its size, and writes the manifest atomically (and an empty rejected.parquet when nothing was rejected, so
    every set has one)."""
    output_dir = str(config.output_dir)
    rejected_file = set_commit.relative(prefix, REJECTED_FILE)
    if not rejected:
        set_commit.write_file(output_dir, rejected_file, encode_rejects([])[0])
    if not shards:
        raise ValueError("no document survived tokenization; there is nothing to write (see rejected.parquet)")
    set_commit.check_written(output_dir, {e["path"]: e["bytes"] for e in shards})
    by_source = layout["stats"]
    rejects: dict[str, dict[str, int]] = {}
    for (source, reason), count in sorted(rejected):
        rejects.setdefault(source, {})[reason] = count
    sources, fill = {}, {}
    total_tokens = sum(by_source.get(source.name, WindowStats()).tokens for source in config.sources)
    for source in config.sources:
        s = by_source.get(source.name, WindowStats())
        realised = round(s.tokens / total_tokens, 6) if total_tokens else 0.0
        sources[source.name] = {**asdict(s), "mixture_weight": source.weight, "realised_weight": realised}
        if plans is not None:  # target against realised: the report's mixture table
            plan = plans[source.name]
            sources[source.name].update(available_tokens=plan.available, target_tokens=plan.target,
                                        repeats=plan.repeats, fraction=round(plan.fraction, 6))
        fill[source.name] = s.tokens / (s.sequences * config.seq_len) if s.sequences else None
    manifest = Manifest(
        tokenizer=tokenizer,
        seq_len=config.seq_len,
        dtype=dtype,
        sources=sources,
        padding_tokens=sum(s["padding_tokens"] for s in sources.values()),
        pad_token_id=pad_id,
        shards=[{k: v for k, v in e.items() if k != "index"} for e in sorted(shards, key=lambda e: e["index"])],
        config_hash=config_hash,
        created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        packing={"strategy": config.packing, "window_documents": config.window_documents, "seed": config.seed},
        fim=config.fim.model_dump(mode="json") if config.fim is not None else None,  # `inspect --locate` undoes it
        mixture=config.mixture.model_dump(mode="json") if config.mixture is not None else None,
        repositories=config.repositories.model_dump(mode="json") if config.repositories is not None else None,
        framing=framing,
        sequences_per_shard=config.sequences_per_shard,
        rows_per_batch=config.rows_per_batch,
        fill_ratio=fill,
        rejected=rejects,
        rejected_file=rejected_file,
        provenance=provenance,  # where each source's documents and the tokenizer are: `ember corpus inspect --locate`
    )
    set_commit.write_file(output_dir, MANIFEST_FILENAME, manifest.model_dump_json(indent=2).encode("utf-8"))
    return storage.join(output_dir, MANIFEST_FILENAME)


def build(pipeline: beam.Pipeline, config: TokenizeConfig, tokenizer: Tokenizer, recorded: TokenizeConfig | None = None,
          progress_dir: str | None = None, prefix: str = "") -> None:
    """Adds the whole tokenize-and-pack graph to `pipeline`. `recorded`, when `config` reads from or writes
    to a staging directory, is the final config: rejects name its source paths, the manifest its hash.
    With `progress_dir`, the tokenize step counts its documents there (ember/pipelines/jobs/progress.py).
    `prefix` is the directory under `config.output_dir` the shards and rejects go to (`set_commit.fresh_prefix`)."""
    recorded = recorded or config
    driver_tokenizer = uuid.uuid4().hex
    _DRIVER_TOKENIZERS[driver_tokenizer] = tokenizer
    source_paths = {s.name: s.path for s in recorded.sources}
    tokenized, lengths, rejects = [], [], []
    for source in config.sources:
        read = pipeline | f"Read {source.name}" >> beam.io.ReadFromParquetBatched(source.path, columns=read_columns(config, source.name))
        if grouped_by_repository(config, source.name):
            read = _repository_documents(read, config, source.name, tokenized, lengths, driver_tokenizer)
        outputs = (
            read
            | f"Tokenize {source.name}"
            >> beam.ParDo(
                TokenizeDocuments(config.tokenizer, source, source_paths[source.name], config.encode_batch_documents,
                                  progress_dir, driver_tokenizer, config.fim)
            ).with_outputs(TokenizeDocuments.LENGTHS, REJECTS, main="documents")
        )
        tokenized.append(outputs.documents)
        lengths.append(outputs[TokenizeDocuments.LENGTHS])
        rejects.append(outputs[REJECTS])
    if len(lengths) > 1:
        lengths = [lengths | "All lengths" >> beam.Flatten()]
    counts = (
        lengths[0]
        | "Per source" >> beam.MapTuple(lambda source, _key, names, _lengths: (source, len(names)))
        | "Count documents" >> beam.CombinePerKey(sum)
    )
    plans = None
    if config.mixture is not None:
        plans = (
            lengths[0]
            | "Tokens per source" >> beam.MapTuple(lambda source, _key, _names, lengths: (source, sum(lengths)))
            | "Sum tokens" >> beam.CombinePerKey(sum)
            | "All sums" >> beam.combiners.ToList()
            | "Plan mixture" >> beam.Map(mixture_plans, config)
        )
    packed = (
        lengths[0]
        | "Assign windows"
        >> beam.FlatMap(assign_windows, counts=beam.pvalue.AsDict(counts), window_documents=config.window_documents,
                        seed=config.seed, plans=beam.pvalue.AsSingleton(plans) if plans is not None else None,
                        mixture_seed=config.mixture.seed if config.mixture else 0)
        | "Group windows" >> beam.GroupByKey()
        | "Pack windows"
        >> beam.ParDo(PackWindow(config.seq_len, config.packing, source_paths)).with_outputs(
            PackWindow.WINDOWS, REJECTS, main="placements"
        )
    )
    rejects.append(packed[REJECTS])
    layout = (packed[PackWindow.WINDOWS] | "Windows" >> beam.combiners.ToList()
              | "Layout" >> beam.Map(window_layout, config.mixture is not None))
    entries = (
        [*tokenized, packed.placements]
        | "Tokens and placements" >> beam.Flatten()
        | "Join per batch" >> beam.GroupByKey()
        | "Route pieces"
        >> beam.ParDo(RoutePieces(config.seed, config.sequences_per_shard), layout=beam.pvalue.AsSingleton(layout))
        | "Group shards" >> beam.GroupByKey()
        | "Write shards"
        >> beam.ParDo(
            WriteShard(
                str(config.output_dir), config.seq_len, tokenizer.pad_id, config.rows_per_batch, config.sequences_per_shard,
                prefix,
            )
        )
    )
    reject_counts = (
        rejects
        | "All rejects" >> beam.Flatten()
        | "Group rejects" >> beam.GroupByKey()
        | "Write rejects" >> beam.ParDo(WriteRejects(str(config.output_dir), prefix))
    )
    provenance = {"documents": source_paths, "tokenizer": recorded.tokenizer.model_dump(mode="json")}
    _ = (
        pipeline
        | "Finish" >> beam.Create([None])
        | "Write manifest"
        >> beam.Map(
            _finish,
            config=config,
            tokenizer=tokenizer.identity.model_dump(),
            framing={"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_id},
            pad_id=tokenizer.pad_id,
            dtype=tokenizer.dtype,
            config_hash=recorded.config_hash(tokenizer.identity.hash),
            provenance=provenance,
            shards=beam.pvalue.AsList(entries),
            layout=beam.pvalue.AsSingleton(layout),
            rejected=beam.pvalue.AsList(reject_counts),
            prefix=prefix,
            plans=beam.pvalue.AsSingleton(plans) if plans is not None else None,
        )
    )


def grouped_by_repository(config: TokenizeConfig, source: str) -> bool:
    repositories = config.repositories
    return repositories is not None and (repositories.sources is None or source in repositories.sources)


def read_columns(config: TokenizeConfig, source: str) -> list[str]:
    """The Document columns tokenize reads: metadata too when the source's files are grouped by repository."""
    return [*REQUIRED_COLUMNS, "metadata"] if grouped_by_repository(config, source) else list(REQUIRED_COLUMNS)


def _repository_documents(read, config: TokenizeConfig, source: str, tokenized: list, lengths: list, driver_tokenizer: str):
    """Files with a repository become one document per repository (their tokens and lengths appended to
    `tokenized` and `lengths`); returns the other row groups, which are tokenized one document at a time."""
    from ember.pipelines.code.documents import SplitRepositories, TokenizeRepositories

    assert config.repositories is not None
    split = read | f"Split repositories {source}" >> beam.ParDo(
        SplitRepositories(source, config.repositories.field)).with_outputs(SplitRepositories.FILES, main="rest")
    repos = (
        split[SplitRepositories.FILES]
        | f"Group repositories {source}" >> beam.GroupByKey()
        | f"Tokenize repositories {source}" >> beam.ParDo(
            TokenizeRepositories(config.tokenizer, config.repositories, config.fim,
                                 functools.partial(driver_or_loaded, driver_tokenizer))).with_outputs(
                TokenizeRepositories.LENGTHS, main="documents")
    )
    tokenized.append(repos.documents)
    lengths.append(repos[TokenizeRepositories.LENGTHS])
    return split.rest


def check_sources(config: TokenizeConfig) -> None:
    """Fails before the pipeline starts when a source matches no file or lacks a required column."""
    problems = []
    for i, source in enumerate(config.sources):
        matched = [m.path for r in FileSystems.match([source.path]) for m in r.metadata_list]
        if not matched:
            problems.append(f"sources.{i}.path: no file matches {source.path}")
        for path in matched:
            try:
                with FileSystems.open(path) as handle:
                    names = pq.read_schema(handle).names
            except Exception as exc:  # pyarrow raises several types for a non-Parquet file
                problems.append(f"sources.{i}.path: {path} is not readable Parquet ({exc})")
                continue
            missing = [c for c in read_columns(config, source.name) if c not in names]
            if missing:
                problems.append(f"sources.{i}.path: {path} lacks Document columns {missing}")
    if problems:
        raise TokenizeConfigError("input is not usable:\n  " + "\n  ".join(problems))


def shard_set_files(directory: Path) -> set[str]:
    """The files a finished shard set in `directory` consists of, by its manifest; none without a readable one."""
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError, SchemaValidationError):
        return set()
    owned = {MANIFEST_FILENAME, *(entry.path for entry in manifest.shards)}
    rejected_file = manifest.model_extra.get("rejected_file")
    return (owned | {rejected_file}) if isinstance(rejected_file, str) else owned


def check_output(directory: Path, overwrite: bool) -> None:
    """An output directory is new or empty, or (with overwrite) holds exactly a shard set ember wrote - nothing else."""
    present = directory.is_dir() and any(directory.iterdir())
    if present and not overwrite:
        raise TokenizeConfigError(f"output_dir: {directory} is not empty; pass --overwrite to replace the shard set in it")
    refuse_foreign(directory, shard_set_files(directory), "output_dir")


def free_space_needed(config: TokenizeConfig) -> int:
    """A floor for the new set: the matched source Parquet bytes times `SHARDS_PER_PARQUET_BYTE`, plus a margin."""
    parquet = sum(m.size_in_bytes for s in config.sources for r in FileSystems.match([s.path]) for m in r.metadata_list)
    return MIN_FREE_BYTES + SHARDS_PER_PARQUET_BYTE * parquet


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.insert(0, DEFAULT_RUNNER)
    return PipelineOptions(args)


def source_documents(config: TokenizeConfig) -> int:
    """Documents in the sources by their Parquet footers (no data read): the total the progress display's ETA needs."""
    total = 0
    for source in config.sources:
        for result in FileSystems.match([source.path]):
            for m in result.metadata_list:
                with FileSystems.open(m.path) as handle:
                    total += pq.ParquetFile(handle).metadata.num_rows
    return total


def write_shard_set(config: TokenizeConfig, beam_args: list[str], tokenizer: Tokenizer, recorded: TokenizeConfig | None = None,
                    console: Console | None = None, prefix: str = "") -> None:
    """Runs the pipeline into `config.output_dir`, which must be new or empty (see `build` for `recorded` and
    `prefix`); with a console, a local run shows documents/s and an ETA while it tokenizes."""
    options = pipeline_options(beam_args)
    if console is None or not runs_locally(options):
        _run_pipeline(config, beam_args, tokenizer, recorded, None, prefix)
        return
    with tempfile.TemporaryDirectory(prefix="ember-progress-") as progress_dir:
        done = threading.Event()
        watcher = threading.Thread(
            target=watch, args=(progress_dir, done, console),
            kwargs={"title": "tokenize", "stages": (STAGE,), "expected": {STAGE: source_documents(config)}},
            name="tokenize-progress", daemon=True,
        )
        watcher.start()
        try:
            _run_pipeline(config, beam_args, tokenizer, recorded, progress_dir, prefix)
        finally:
            done.set()
            watcher.join()


def _run_pipeline(config: TokenizeConfig, beam_args: list[str], tokenizer: Tokenizer, recorded: TokenizeConfig | None,
                  progress_dir: str | None, prefix: str = "") -> None:
    """The Beam job; under `stop_on_signals()` in a job process that a stop signal ends whole (the tokenizer is
    loaded there)."""
    if isolating():
        run_job(_pipeline_in_job_process, config, list(beam_args), recorded, progress_dir, prefix)
        return
    options = pipeline_options(beam_args)
    pipeline = beam.Pipeline(options=options)
    build(pipeline, config, tokenizer, recorded, progress_dir, prefix)
    run_pipeline(pipeline, options, STAGE)


def _pipeline_in_job_process(config: TokenizeConfig, beam_args: list[str], recorded: TokenizeConfig | None,
                             progress_dir: str | None, prefix: str) -> None:
    _run_pipeline(config, beam_args, load_tokenizer(config.tokenizer), recorded, progress_dir, prefix)


def preflight_sources(config: TokenizeConfig) -> None:
    """Before any work: each gs:// or s3:// source's bucket is reachable with the credentials at hand."""
    try:
        for source in config.sources:
            if storage.is_url(source.path):
                storage.preflight(source.path)
    except storage.StorageError as exc:
        raise OutputUnusable(str(exc)) from None


def preflight_url_output(config: TokenizeConfig, overwrite: bool) -> set[str]:
    """Before any work on a set for URL `config.output_dir`: the output can be written, and it holds nothing, or (with
    overwrite) exactly a finished set ember wrote, whose files are returned for `write_to_url` to replace. Leftovers of
    an interrupted run (no manifest) or files the set does not list are refused with what was found: never mixed into
    a new set, never deleted."""
    location = str(config.output_dir)
    try:
        storage.preflight(location, write=True)
        state = storage.output_state(location)
    except storage.StorageError as exc:
        raise OutputUnusable(str(exc)) from None
    if not state.files:
        return set()
    if not (overwrite and state.finished):
        hint = "pass --overwrite to replace it" if state.finished else "delete them or choose a new output_dir"
        raise OutputUnusable(f"output_dir: {state.describe()}; {hint}")
    owned = remote_set_files(location) | set_commit.unlisted_attempts(state.files)
    foreign = sorted(set(state.files) - owned)
    if foreign:
        raise OutputUnusable(
            f"output_dir: {location} holds files its {MANIFEST_FILENAME} does not list ({', '.join(foreign[:5])}); "
            "--overwrite replaces only a shard set ember wrote: move them or choose a new output_dir"
        )
    return owned


def remote_set_files(location: str) -> set[str]:
    """`shard_set_files` of a set on an object store, from its manifest alone."""
    with tempfile.TemporaryDirectory(prefix="ember-manifest-") as local:
        Path(local, MANIFEST_FILENAME).write_bytes(storage.read_bytes(storage.join(location, MANIFEST_FILENAME)))
        return shard_set_files(Path(local))


def write_to_url(config: TokenizeConfig, beam_args: list[str], tokenizer: Tokenizer | None, recorded: TokenizeConfig,
                 console: Console | None = None, previous: Iterable[str] = ()) -> Manifest:
    """A shard set for a gs:// or s3:// `config.output_dir`, written there by the workers themselves and committed by
    its manifest, written last (ember/pipelines/jobs/set_commit.py). `previous`, the files of the set being replaced
    (`preflight_url_output`), stay readable until the new manifest replaces the old one in one write: the new set goes
    under a fresh prefix beside them, and they are deleted only after the switch."""
    location = str(config.output_dir)
    previous = set(previous)
    prefix = set_commit.fresh_prefix(previous)
    write_shard_set(config, beam_args, tokenizer or load_tokenizer(config.tokenizer), recorded, console=console,
                    prefix=prefix)
    manifest_url = storage.join(location, MANIFEST_FILENAME)
    manifest = parse_manifest(json.loads(storage.read_bytes(manifest_url)), manifest_url)
    listed = {MANIFEST_FILENAME, *(e.path for e in manifest.shards), manifest.model_extra["rejected_file"]}
    set_commit.retire(location, prefix, listed, previous)
    return manifest


def run(
    config: TokenizeConfig,
    beam_args: list[str] = (),
    overwrite: bool = False,
    tokenizer: Tokenizer | None = None,
    min_free_bytes: int | None = None,
    recorded: TokenizeConfig | None = None,
    console: Console | None = None,
) -> Manifest:
    """Validates everything that can be checked up front, runs the pipeline into a staging directory and
    swaps it in, returns the manifest. `tokenizer`, when the caller has already loaded `config.tokenizer`,
    is used instead of loading it again; `min_free_bytes` overrides the free-space floor estimated from the sources;
    `recorded` is the config the manifest describes when `config`'s sources are themselves staged (see `build`);
    with a console, a local run shows its progress."""
    to_url = storage.is_url(config.output_dir)
    options = pipeline_options(beam_args)
    set_commit.refuse_unshared_disk(config.output_dir, options, "output_dir")
    for i, source in enumerate(config.sources):
        set_commit.refuse_unshared_disk(source.path, options, f"sources.{i}.path")
    if config.tokenizer.path is not None:
        set_commit.refuse_unshared_disk(config.tokenizer.path, options, "tokenizer.path", set_commit.NAMED_TOKENIZER)
    preflight_sources(config)
    previous = preflight_url_output(config, overwrite) if to_url else set()
    tokenizer = tokenizer or load_tokenizer(config.tokenizer)
    if config.fim is not None:
        fim.resolve_ids(config.fim, tokenizer)  # FIM tokens the tokenizer lacks: refused before any work
    check_sources(config)
    if to_url:
        return write_to_url(config, beam_args, tokenizer, recorded or config, console, previous)
    target = Path(os.path.abspath(config.output_dir))
    check_output(target, overwrite)
    check_room(target, free_space_needed(config) if min_free_bytes is None else min_free_bytes, "output_dir")
    with staged(target, shard_set_files, "output_dir") as staging:
        write_shard_set(config.model_copy(update={"output_dir": staging}), beam_args, tokenizer, recorded=recorded or config,
                        console=console)
    return read_manifest(target)
