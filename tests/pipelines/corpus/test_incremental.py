"""Near dedup against an earlier release's MinHash index (ember/pipelines/corpus/incremental.py), on FnApiRunner:
release 1 saves its index on an object store, release 2 (which overlaps it) dedups against it, and its clusters
restricted to the new documents equal those of one near-dedup run over both releases."""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest

from ember import storage
from ember.configs import CorpusConfigError
from ember.demo.sample_corpus import near_duplicate, prose
from ember.pipelines.corpus.config import CorpusConfig, Dedup, parse_config
from ember.pipelines.corpus.incremental import INDEX_FILE, IncrementalNearDedup, check_indexes
from ember.pipelines.corpus.outputs import assemble_stats
from ember.pipelines.corpus.stages import EARLIER_RELEASE_REASON, NearDedup
from ember.pipelines.jobs.output_guard import OutputUnusable
from tests.pipelines.corpus.test_stages import _row

pytestmark = pytest.mark.integration


def releases() -> tuple[list[dict], list[dict]]:
    """Release 1: clusters and singletons. Release 2: variants of release-1 documents (one with more stars than its
    release-1 original, which a full rebuild would keep instead), a cluster of its own, new singletons, and a variant
    that bridges two release-1 clusters."""
    rng = random.Random(7)
    old = [prose(rng, 14) for _ in range(6)]
    first = [_row(f"a{i}", t, "mit", 10, i) for i, t in enumerate(old)]
    first += [_row("a0v", near_duplicate(rng, old[0], 2), "mit", 5, 20), _row("a1v", near_duplicate(rng, old[1], 2), "mit", 5, 21)]
    fresh = prose(rng, 14)
    second = [
        _row("b0", near_duplicate(rng, old[0], 2), "mit", 1, 100),
        _row("b2", near_duplicate(rng, old[2], 2), "mit", 900, 101),  # outranks a2: a full rebuild keeps b2
        _row("c", fresh, "mit", 3, 102),
        _row("cv", near_duplicate(rng, fresh, 2), "mit", 4, 103),
        *(_row(f"n{i}", prose(rng, 14), "mit", 1, 110 + i) for i in range(4)),
    ]
    return first, second


def run_stage(rows: list[dict], stage: beam.PTransform, out: Path) -> dict[str, list]:
    """The stage's four outputs, collected into a pickle file each."""
    with beam.Pipeline(runner="FnApiRunner") as p:
        outputs = p | beam.Create(rows) | stage
        for name, pcoll in outputs._asdict().items():
            _ = (pcoll | f"All{name}" >> beam.combiners.ToList()
                 | f"Save{name}" >> beam.Map(lambda items, n=name: (out / f"{n}.pkl").write_bytes(pickle.dumps(items))))
    return {name: pickle.loads((out / f"{name}.pkl").read_bytes()) for name in ("documents", "rejects", "clusters", "stats")}


def cluster_of(clusters: list[dict], ids: set[str]) -> dict[str, str | None]:
    """Each of `ids`' near-dedup cluster id (None: in no cluster)."""
    found = {c["document_id"]: c["cluster_id"] for c in clusters if c["stage"] == "near_dedup"}
    return {i: found.get(i) for i in sorted(ids)}


def config(**dedup) -> CorpusConfig:
    return parse_config({"sources": [{"name": "code", "kind": "code", "inputs": ["x"]}], "output": {"directory": "o"},
                         "dedup": dedup})


def test_release_two_against_release_ones_index_clusters_new_documents_as_a_full_rebuild(gs_bucket, tmp_path) -> None:
    first, second = releases()
    index = f"{gs_bucket}/release-1/minhash"
    (tmp_path / "r1").mkdir(), (tmp_path / "r2").mkdir(), (tmp_path / "full").mkdir()
    check_indexes(config(index=index))  # as a build does first: the location is empty
    one = run_stage(first, IncrementalNearDedup(Dedup(index=index), None, rows_per_shard=16), tmp_path / "r1")
    saved = json.loads(storage.read_bytes(f"{index}/{INDEX_FILE}"))
    assert saved["settings"]["bands"] == Dedup().bands and len(saved["parts"]) > 1
    assert sorted(storage.list_files(index)) == sorted([INDEX_FILE, *saved["parts"]])
    assert sum(pq.read_metadata(io.BytesIO(storage.read_bytes(f"{index}/{part}"))).num_rows
               for part in saved["parts"]) == len(first) * Dedup().bands, "every band key of every document"
    assert {r["document_id"] for r in one["rejects"]} == {"code:a0v", "code:a1v"}, "saving an index changes no verdict"

    check_indexes(config(against=[index]))
    two = run_stage(second, IncrementalNearDedup(Dedup(against=[index]), None, rows_per_shard=16), tmp_path / "r2")
    full = run_stage(first + second, NearDedup(Dedup(), None), tmp_path / "full")

    new = {r["id"] for r in second}
    assert cluster_of(two["clusters"], new) == cluster_of(full["clusters"], new)
    assert cluster_of(two["clusters"], new)["code:b2"] == "code:b2", "b2 roots its component in the full rebuild too"
    earlier = {r["document_id"] for r in two["rejects"] if r["reason"] == EARLIER_RELEASE_REASON}
    assert earlier == {"code:b0", "code:b2"}, "every new document in a component with an indexed one, b2 included"
    within = {r["document_id"] for r in two["rejects"] if r["reason"] == "near_duplicate"}
    assert within == {"code:c"} and {d["id"] for d in two["documents"]} == new - earlier - within
    assert {d["id"] for d in full["documents"]} & new == new - within - {"code:b0"}, "a full rebuild keeps b2, drops a2"

    events = [((r["source"], r["stage"], f"rejected.{r['reason']}"), 1) for r in two["rejects"]]
    stats = assemble_stats(events, config(against=[index]))
    assert stats["dedup"]["near_dedup"]["earlier_release_removed"] == 2 and stats["dedup"]["near_dedup"]["removed"] == 1


def test_indexes_are_checked_before_any_work(gs_bucket, tmp_path) -> None:
    storage.write_bytes(f"{gs_bucket}/used/bands/part-00000-of-00001.parquet", b"an earlier index")
    with pytest.raises(OutputUnusable, match=f"dedup.index: {gs_bucket}/used is not empty"):
        check_indexes(config(index=f"{gs_bucket}/used"))
    with pytest.raises(CorpusConfigError, match=f"dedup.against.0: {gs_bucket}/used/{INDEX_FILE} does not exist"):
        check_indexes(config(against=[f"{gs_bucket}/used"]))
    storage.write_bytes(f"{gs_bucket}/used/{INDEX_FILE}", json.dumps(
        {"schema": "ember.minhash_index", "settings": {**Dedup().model_dump(), "bands": 20}, "parts": []}).encode())
    with pytest.raises(CorpusConfigError, match=r"dedup.against.0: .* other MinHash settings: bands 20 \(this build: 14\)"):
        check_indexes(config(against=[f"{gs_bucket}/used"]))
    with pytest.raises(ValueError, match="set near: true"):
        config(near=False, against=[f"{gs_bucket}/used"])
