"""The dataset over real shard sets: rows read back exactly, GPT sample fields, blend, validation,
and shards verified against their manifest before any of their data is used."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from re import escape as re_escape

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from ember.midtrain.data import (
    DataError,
    GlobalOrderSampler,
    MidtrainDataset,
    ShardSetSpec,
    check_model_compatible,
    gpt_sample,
    open_manifests,
    thd_cu_seqlens,
)
from ember.schemas import Manifest
from ember.tokenize.shardset import ShardVerifier, file_sha256
from .shardsets import TOKENIZER, packed_rows, write_shard_set

SEQ = 32
RACY_NS = 50_000_000  # these verifiers trust a file for a marker once it has not changed for 50 ms


@pytest.fixture(autouse=True)
def marker_cache(tmp_path, monkeypatch):
    """The loader's default verified-once markers go to this test's tmp dir, not ~/.cache."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shards")
    code_rows = packed_rows(90, SEQ, seed=1, source="code", with_loss_mask=True)
    web_rows = packed_rows(40, SEQ, seed=2, source="web") + packed_rows(10, SEQ, seed=3, source="docs")
    code = write_shard_set(root / "code", code_rows, seq_len=SEQ, rows_per_shard=40, rows_per_batch=8)
    # a writer without the rows-per-batch metadata: batch lengths come from the batch headers
    web = write_shard_set(root / "web", web_rows, seq_len=SEQ, rows_per_shard=25, rows_per_batch=6, batch_metadata=False)
    return {"code": (code, code_rows), "web": (web, web_rows)}


def _dataset(shard_sets, **overrides) -> MidtrainDataset:
    args = dict(num_samples=400, seed=7, blend_period=10, window_chunks=2, dense_attention_mask=True)
    args.update(overrides)
    specs = [ShardSetSpec(shard_sets["code"][0], 0.7), ShardSetSpec(shard_sets["web"][0], 0.3)]
    return MidtrainDataset(specs, **args)


def test_samples_are_the_rows_written(shard_sets):
    ds = _dataset(shard_sets)
    assert ds.source_names == ["code", "docs", "web"]
    written = [shard_sets["code"][1], shard_sets["web"][1]]
    masked_rows = 0
    for position in range(0, 300, 7):
        sample = ds[position]
        set_index, epoch, row = ds.locate(position)
        expected = written[set_index][row]
        assert sample["tokens"].tolist() == expected["tokens"]
        assert ds.source_names[int(sample["source_id"])] == expected["source"]
        cu = sample["cu_seqlens"][sample["cu_seqlens"] >= 0].tolist()
        assert cu[: len(expected["cu_seqlens"])] == expected["cu_seqlens"]
        assert (int(sample["shard_set"]), int(sample["epoch"]), int(sample["row"])) == (set_index, epoch, row)
        assert int(sample["sample_id"]) == position
        if expected["loss_mask"] is not None:  # a target the row excludes is never trained
            untrained = np.flatnonzero(np.asarray(expected["loss_mask"][1:]) == 0)
            assert sample["loss_mask"][untrained].sum() == 0
            masked_rows += 1
    assert masked_rows > 0


def test_blend_and_epochs_over_real_shard_sets(shard_sets):
    ds = _dataset(shard_sets)
    located = [ds.locate(p) for p in range(300)]
    sets = np.array([s for s, _, _ in located])
    for window in range(30):  # blend period 10: exactly 7 code + 3 web in every window
        assert np.bincount(sets[window * 10 : (window + 1) * 10], minlength=2).tolist() == [7, 3]
    code = [(e, r) for s, e, r in located if s == 0]  # 210 draws of 90 rows: epochs 0, 1 and part of 2
    for epoch in (0, 1):
        assert sorted(r for e, r in code if e == epoch) == list(range(90))
    assert [r for e, r in code if e == 0] != [r for e, r in code if e == 1]


def test_gpt_sample_masks_document_ends_padding_and_untrained_targets():
    tokens = np.arange(10, 20, dtype=np.uint32)
    cu = np.array([0, 3, 7, 8])  # documents [0,3) [3,7) [7,8), padding [8,10)
    row_mask = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=np.uint8)  # token 2 is not a target
    s = gpt_sample(tokens, cu, row_mask, pad_token_id=0, dense_mask=True)
    assert s["labels"].tolist() == [11, 12, 13, 14, 15, 16, 17, 18, 19, 0]
    assert s["loss_mask"].tolist() == [1, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0, 1]
    assert s["cu_seqlens"].tolist() == [0, 3, 7, 8, 10] + [-1] * 6
    assert int(s["max_seqlen"]) == 4
    mask = s["attention_mask"][0]  # True = masked
    segment = [0, 0, 0, 1, 1, 1, 1, 2, 3, 3]
    for q in range(10):
        for k in range(10):
            assert mask[q, k] == (k > q or segment[q] != segment[k])


def test_thd_cu_seqlens_flattens_the_micro_batch():
    cu = torch.tensor([[0, 3, 8, -1, -1], [0, 8, -1, -1, -1]], dtype=torch.int32)
    assert thd_cu_seqlens(cu, 8).tolist() == [0, 3, 8, 16]


def test_rank_loaders_cover_each_global_micro_batch_once(shard_sets):
    ds = _dataset(shard_sets, dense_attention_mask=False)
    seen = []
    for rank in range(2):
        loader = torch.utils.data.DataLoader(ds, batch_sampler=GlobalOrderSampler(8, 40, 2, 2, rank))
        batches = list(loader)
        assert "attention_mask" not in batches[0]
        assert batches[0]["tokens"].shape == (2, SEQ)
        seen.append([b["sample_id"].tolist() for b in batches])
    assert [i for step in zip(*seen) for ids in step for i in ids] == list(range(8, 40))


def test_model_mismatch_is_reported_with_the_shard_set_and_key(shard_sets):
    specs = [ShardSetSpec(shard_sets["code"][0], 1.0)]
    manifests = open_manifests(specs)
    check_model_compatible(specs, manifests, vocab_size=128, seq_len=SEQ, tokenizer_name=TOKENIZER["name"])
    with pytest.raises(DataError) as exc:
        check_model_compatible(specs, manifests, vocab_size=256, seq_len=64, tokenizer_name="other-bpe")
    message = str(exc.value)
    assert "tokenizer 'test-counting', model.tokenizer is 'other-bpe'" in message
    assert "tokenizer vocab_size 128, model.vocab_size is 256" in message
    assert f"seq_len {SEQ}, model.seq_len is 64" in message
    assert str(shard_sets["code"][0]) in message


def test_shard_sets_from_different_tokenizers_are_refused(tmp_path, shard_sets):
    other = write_shard_set(
        tmp_path / "other", packed_rows(4, SEQ, 5, "code"), seq_len=SEQ, rows_per_shard=4, rows_per_batch=4,
        tokenizer={**TOKENIZER, "hash": "0123456789abcdef"},
    )
    specs = [ShardSetSpec(shard_sets["code"][0], 1.0), ShardSetSpec(other, 1.0)]
    with pytest.raises(DataError, match="different tokenizers"):
        check_model_compatible(specs, open_manifests(specs), vocab_size=128, seq_len=SEQ, tokenizer_name=TOKENIZER["name"])


def test_missing_unfinished_and_incomplete_shard_sets_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        open_manifests([ShardSetSpec(tmp_path / "nope", 1.0)])
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(DataError, match="not a finished shard set"):
        open_manifests([ShardSetSpec(tmp_path / "unfinished", 1.0)])
    done = write_shard_set(tmp_path / "done", packed_rows(6, SEQ, 4, "code"), seq_len=SEQ, rows_per_shard=3, rows_per_batch=2)
    (done / "shard-000001.arrow").unlink()
    with pytest.raises(DataError, match=r"incomplete: missing \['shard-000001.arrow'\]"):
        open_manifests([ShardSetSpec(done, 1.0)])


def test_a_row_of_the_wrong_length_is_refused(tmp_path):
    rows = packed_rows(3, SEQ, 9, "code")
    rows[1] = {**rows[1], "tokens": rows[1]["tokens"][:-1]}
    path = write_shard_set(tmp_path / "set", rows, seq_len=SEQ, rows_per_shard=3, rows_per_batch=3)
    ds = MidtrainDataset([ShardSetSpec(path, 1.0)], num_samples=3, seed=0, blend_period=1, window_chunks=1, dense_attention_mask=False)
    with pytest.raises(DataError, match=f"{path / 'shard-000000.arrow'} row 1: a row holds {SEQ - 1} tokens, seq_len is {SEQ}"):
        ds[0]


def small_set(directory, rows: list[dict] | None = None):
    """Two shards of 6 rows, 16 tokens each, in record batches of 2 rows: a few KB in all."""
    rows = rows or packed_rows(12, 16, 11, "code", with_loss_mask=True)
    return write_shard_set(directory, rows, seq_len=16, rows_per_shard=6, rows_per_batch=2)


def load(path, verifier: ShardVerifier | None = None, manifests=None) -> MidtrainDataset:
    return MidtrainDataset(
        [ShardSetSpec(path, 1.0)], num_samples=12, seed=0, blend_period=1, window_chunks=1,
        dense_attention_mask=False, manifests=manifests, verifier=verifier,
    )


def write_byte(path, offset: int, value: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes([value]))


def test_single_bit_flips_across_a_shard_are_all_refused_by_the_loader(tmp_path):
    path = small_set(tmp_path / "set")
    manifests = open_manifests([ShardSetSpec(path, 1.0)])
    verifier = ShardVerifier(tmp_path / "markers", racy_ns=RACY_NS)
    time.sleep(3 * RACY_NS / 1e9)
    load(path, verifier, manifests)
    assert len(list((tmp_path / "markers").glob("*.json"))) == 2  # both shards verified once, markers kept
    shard = path / "shard-000001.arrow"
    original, before = shard.read_bytes(), shard.stat()
    offsets = range(0, len(original), 5)  # every 5th byte, header to footer, bit offset % 8 in each
    assert len(offsets) > 400
    for offset in offsets:
        write_byte(shard, offset, original[offset] ^ (1 << (offset % 8)))
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: only the hash can tell
        with pytest.raises(DataError, match=f"shard set {path} does not match its manifest: {shard}: sha256 mismatch"):
            load(path, verifier, manifests)
        write_byte(shard, offset, original[offset])
    assert shard.read_bytes() == original
    assert load(path, verifier, manifests)[0]["tokens"].shape == (16,)


@pytest.mark.parametrize("damage", ["truncated", "missing", "wrong sha256 in the manifest"])
def test_a_damaged_shard_is_refused_naming_it(tmp_path, damage):
    path = small_set(tmp_path / "set")
    shard = path / "shard-000001.arrow"
    if damage == "truncated":
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[:-10])
        expected = f"size differs from manifest ['shard-000001.arrow']"
        direct = f"{shard}: {size - 10} bytes, the manifest says {size}"
    elif damage == "missing":
        shard.unlink()
        expected = "missing ['shard-000001.arrow']"
        direct = f"{shard}: missing"
    else:
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["shards"][1]["sha256"] = "ab" * 32
        (path / "manifest.json").write_text(json.dumps(manifest))
        expected = direct = f"{shard}: sha256 mismatch: the file hashes to {file_sha256(shard)[:16]}..., the manifest says abababab"
    with pytest.raises(DataError, match=re_escape(expected)):
        load(path)  # what `midtrain train` does: manifests, then the dataset
    manifest = json.loads((path / "manifest.json").read_text())
    with pytest.raises(DataError, match=re_escape(direct)):  # and with the manifests handed in
        load(path, manifests=[Manifest.model_validate(manifest)])


@pytest.mark.parametrize("outside", ["../other/shard-000000.arrow", "ABSOLUTE"])
def test_a_manifest_path_outside_the_set_is_refused_by_the_loader(tmp_path, outside):
    path = small_set(tmp_path / "set")
    other = small_set(tmp_path / "other")
    manifest = json.loads((path / "manifest.json").read_text())
    name = str(other / "shard-000000.arrow") if outside == "ABSOLUTE" else outside
    manifest["shards"][0] = {**json.loads((other / "manifest.json").read_text())["shards"][0], "path": name}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=re_escape(f"{name!r}: must be a relative name inside the shard set")):
        load(path)


def test_token_ids_outside_the_vocabulary_are_refused_with_shard_and_row(tmp_path):
    rows = packed_rows(12, 16, 11, "code")
    rows[9]["tokens"][5] = 200  # vocab_size is 128; the manifest's sha256 is of these very bytes
    path = small_set(tmp_path / "set", rows)
    ds = load(path)
    message = f"{path / 'shard-000001.arrow'} row 3 position 5: token id 200 is outside the vocabulary (tokenizer.vocab_size 128)"
    with pytest.raises(DataError, match=re_escape(message)):
        for position in range(len(ds)):
            ds[position]


@pytest.mark.parametrize("bug", ["boundaries", "loss mask length", "unknown source"])
def test_rows_no_writer_should_produce_are_refused_with_shard_and_row(tmp_path, bug):
    rows = packed_rows(12, 16, 11, "code", with_loss_mask=True)
    shard = tmp_path / "set" / "shard-000000.arrow"
    if bug == "boundaries":
        rows[4]["cu_seqlens"] = [0, 9, 5, 12]
        message = re_escape(f"{shard} row 4: cu_seqlens must start at 0, increase strictly and end <= 16")
    elif bug == "loss mask length":
        rows[3]["loss_mask"] = rows[3]["loss_mask"][:-2]
        message = re_escape(f"{shard} row 3: loss_mask holds 14 values, seq_len is 16")
    path = small_set(tmp_path / "set", rows)
    if bug == "unknown source":  # the manifest counts the rows under another source name
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["sources"] = {"web": manifest["sources"]["code"]}
        (path / "manifest.json").write_text(json.dumps(manifest))
        message = re_escape(str(path)) + r"/shard-00000[01]\.arrow rows from \d+: source 'code' is not among the manifest's sources"
    ds = load(path)
    with pytest.raises(DataError, match=message):
        for position in range(len(ds)):
            ds[position]


def test_a_worker_refuses_a_shard_changed_after_verification(tmp_path):
    path = small_set(tmp_path / "set")
    ds = load(path)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)
    assert [b["tokens"].shape for b in loader] == [(4, 16)] * 3  # workers map the verified files
    shard = path / "shard-000000.arrow"
    shard.write_bytes(shard.read_bytes())  # same bytes, a new version of the file
    os.utime(shard, ns=(0, 10**18))
    with pytest.raises(DataError, match=re_escape(f"{shard}: changed after it was verified against the manifest")):
        list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1))


def rewrite_shard(path, name: str, table: pa.Table, compression: str | None = "zstd", patch=None) -> Path:
    """Writes `table` as shard `name` of the set (then `patch` edits its bytes) and records the new size and
    sha256 in the manifest: a writer's bug, not damage, so only the loader's own checks can catch it."""
    shard = path / name
    with ipc.new_file(shard, table.schema, options=ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_table(table, max_chunksize=2)
    if patch:
        shard.write_bytes(patch(shard.read_bytes()))
    manifest = json.loads((path / "manifest.json").read_text())
    entry = next(e for e in manifest["shards"] if e["path"] == name)
    entry.update(bytes=shard.stat().st_size, sha256=file_sha256(shard))
    (path / "manifest.json").write_text(json.dumps(manifest))
    return shard


def test_a_shard_whose_columns_have_other_types_is_refused_naming_the_column(tmp_path):
    """Checked once per shard as it is opened: every record batch's buffers are then read as these types say."""
    path = small_set(tmp_path / "set")
    table = ipc.open_file(path / "shard-000001.arrow").read_all()
    tokens = table.column("tokens").cast(pa.list_(pa.int64()))
    shard = rewrite_shard(path, "shard-000001.arrow", table.set_column(0, "tokens", tokens))
    message = f"{shard}: column tokens is list<item: int64>, a PACKED_SEQUENCE_SCHEMA shard has list<item: uint32>"
    with pytest.raises(DataError, match=re_escape(message)):
        load(path)


def test_a_record_batch_whose_offsets_leave_its_buffers_is_refused(tmp_path):
    """Arrow's reader does not check offsets against the buffers they index; the loader validates each batch
    before it views them, so a bad offset is an error naming the shard, never a read out of bounds."""
    path = small_set(tmp_path / "set")
    good = np.array([0, 16, 32], dtype=np.int32).tobytes()  # the first record batch's token offsets (2 rows of 16)
    bad = np.array([0, 16, 4000], dtype=np.int32).tobytes()
    table = ipc.open_file(path / "shard-000000.arrow").read_all()
    shard = rewrite_shard(path, "shard-000000.arrow", table, compression=None, patch=lambda b: b.replace(good, bad, 1))
    ds = load(path)
    with pytest.raises(DataError, match=re_escape(f"{shard} rows from 0: not a valid record batch (")):
        for position in range(len(ds)):
            ds[position]
