"""Read-ahead in the sampler's order: the samples are exactly those of a plain read (from any resume
point, in worker processes too), each block decodes a record batch at most once, and the decoded
bytes a process holds stay under the cache budget."""

from __future__ import annotations

import tempfile
from pathlib import Path
from re import escape as re_escape

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.midtrain.data import DataError, GlobalOrderSampler, MidtrainDataset, ShardSetSpec, row_bytes_bound
from .shardsets import packed_rows, write_shard_set

SEQ = 32
GLOBAL = 10**6  # one shuffle window over every record batch


@pytest.fixture(autouse=True)
def marker_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> list[ShardSetSpec]:
    """Two sets, 22 record batches in all (one set with loss masks, one with two sources)."""
    root = tmp_path_factory.mktemp("read-ahead")
    code = write_shard_set(root / "code", packed_rows(90, SEQ, seed=1, source="code", with_loss_mask=True),
                           seq_len=SEQ, rows_per_shard=40, rows_per_batch=8)
    web = write_shard_set(root / "web", packed_rows(40, SEQ, seed=2, source="web") + packed_rows(10, SEQ, seed=3, source="docs"),
                          seq_len=SEQ, rows_per_shard=25, rows_per_batch=6)
    return [ShardSetSpec(code, 0.7), ShardSetSpec(web, 0.3)]


def _dataset(specs, cache_kib: int, window_chunks: int = GLOBAL) -> MidtrainDataset:
    return MidtrainDataset(specs, num_samples=400, seed=7, blend_period=10, window_chunks=window_chunks,
                           dense_attention_mask=False, cache_bytes=cache_kib * 1024)


def _read(ds: MidtrainDataset, sampler: GlobalOrderSampler, workers: int) -> dict[int, dict[str, torch.Tensor]]:
    ds.read_ahead(sampler)
    out = {}
    for batch in torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers):
        for j, position in enumerate(batch["sample_id"].tolist()):
            assert position not in out
            out[position] = {k: v[j] for k, v in batch.items()}
    return out


@pytest.mark.parametrize("cache_kib, window_chunks, workers, consumed", [
    (1, GLOBAL, 0, 0), (8, GLOBAL, 0, 12), (30, GLOBAL, 2, 20), (8, 2, 0, 4), (1024, GLOBAL, 0, 0),
])
def test_read_ahead_returns_exactly_the_plain_samples_from_any_resume_point(specs, cache_kib, window_chunks, workers, consumed):
    """Per rank of 2, micro-batches of 2, from `consumed` on: every sample equals the one read without
    read-ahead at its position, and the ranks together read each position after `consumed` once."""
    plain = MidtrainDataset(specs, num_samples=400, seed=7, blend_period=10, window_chunks=window_chunks,
                            dense_attention_mask=False)
    seen = set()
    for rank in range(2):
        got = _read(_dataset(specs, cache_kib, window_chunks), GlobalOrderSampler(consumed, 120, 2, 2, rank), workers)
        for position, sample in got.items():
            expected = plain[position]
            assert sample.keys() == expected.keys()
            for key in expected:
                assert torch.equal(sample[key], expected[key]), (position, key)
        seen |= got.keys()
    assert seen == set(range(consumed, 120))


@pytest.mark.parametrize("cache_kib", [8, 12, 24])
def test_each_block_decodes_a_record_batch_once_and_holds_at_most_the_budget(specs, cache_kib):
    """Budgets too small for a whole epoch's batches (22 of ~1.5 KiB), large enough for a few."""
    ds = _dataset(specs, cache_kib)
    ahead_rows, total = ds.ahead_rows, 200
    assert 1 < ahead_rows < total
    _read(ds, GlobalOrderSampler(0, total, 4, 1, 0), workers=0)
    per_block = 0
    for start in range(0, total, ahead_rows):  # one process reads 0..total-1, so block k is [k*ahead, (k+1)*ahead)
        batches = set()
        for position in range(start, min(start + ahead_rows, total)):
            set_index, _, row = ds.locate(position)
            batches.add((set_index, *ds.sets[set_index].locate(row)[:2]))
        per_block += len(batches)
    assert 0 < ds.stats.decoded_batches <= per_block
    assert 0 < ds.stats.peak_bytes <= cache_kib * 1024
    assert ahead_rows * row_bytes_bound(SEQ) <= cache_kib * 1024
    assert ds.held_bytes <= ds.stats.peak_bytes


def test_a_read_off_the_plan_is_still_exact(specs):
    """A position the sampler would not give this process is read alone, not refused or mixed up."""
    ds, plain = _dataset(specs, 8), _dataset(specs, 8)
    ds.read_ahead(GlobalOrderSampler(0, 100, 2, 2, 0))
    for position in (2, 0, 399, 5):  # another rank's, this rank's, past the sampler's total, another rank's
        assert torch.equal(ds[position]["tokens"], plain[position]["tokens"])


def test_a_cache_without_bytes_is_refused(specs):
    with pytest.raises(DataError, match="cache_bytes must be positive, got 0"):
        MidtrainDataset(specs, num_samples=4, seed=0, blend_period=10, window_chunks=2, dense_attention_mask=False, cache_bytes=0)


def _bad_set(directory, bug: str):
    """One set of 12 rows of 16 tokens in batches of 2 (two shards), with one row no writer should produce,
    and the message the loader must give for it (naming the shard and the row in it)."""
    rows = packed_rows(12, 16, 11, "code", with_loss_mask=True)
    shard = directory / "shard-000001.arrow"  # rows 6..11 of the set; set row 9 is its row 3
    if bug == "vocab":
        rows[9]["tokens"][5] = 200
        message = f"{shard} row 3 position 5: token id 200 is outside the vocabulary (tokenizer.vocab_size 128)"
    elif bug == "boundaries":
        rows[9]["cu_seqlens"] = [0, 9, 5, 12]
        message = f"{shard} row 3: cu_seqlens must start at 0, increase strictly and end <= 16"
    elif bug == "too few boundaries":
        rows[9]["cu_seqlens"] = [0]
        message = f"{shard} row 3: cu_seqlens holds fewer than 2 boundaries"
    elif bug == "row length":
        rows[9]["tokens"] = rows[9]["tokens"][:-1]
        message = f"{shard} row 3: a row holds 15 tokens, seq_len is 16"
    else:
        rows[9]["loss_mask"] = [1] * 14
        message = f"{shard} row 3: loss_mask holds 14 values, seq_len is 16"
    return write_shard_set(directory, rows, seq_len=16, rows_per_shard=6, rows_per_batch=2), message


@pytest.mark.parametrize("bug", ["vocab", "boundaries", "too few boundaries", "row length", "loss mask length"])
@pytest.mark.parametrize("window_chunks", [1, GLOBAL])
def test_read_ahead_refuses_a_row_no_writer_should_produce_naming_shard_and_row(tmp_path, bug, window_chunks):
    """The checks that run on a block's rows at once (or on a batch as it is decoded) name the same row as a
    plain read does."""
    path, message = _bad_set(tmp_path / "set", bug)
    ds = MidtrainDataset([ShardSetSpec(path, 1.0)], num_samples=12, seed=0, blend_period=1, window_chunks=window_chunks,
                         dense_attention_mask=False, cache_bytes=4096)
    with pytest.raises(DataError, match=re_escape(message)):
        _read(ds, GlobalOrderSampler(0, 12, 2, 1, 0), workers=0)
    with pytest.raises(DataError, match=re_escape(message)):  # and without read-ahead, reading every position
        plain = MidtrainDataset([ShardSetSpec(path, 1.0)], num_samples=12, seed=0, blend_period=1,
                                window_chunks=window_chunks, dense_attention_mask=False)
        for position in range(12):
            plain[position]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["code", "docs", "web"]), min_size=2, max_size=20), st.integers(1, 4))
def test_each_row_keeps_its_own_source_whatever_the_mix_in_its_batch(sources, rows_per_batch):
    """Source ids are remembered per distinct source column: batches of one name, mixed batches and
    repeats of either give every row its own source, read ahead in a global shuffle or read alone."""
    rows = [packed_rows(1, 8, seed=i, source=name)[0] for i, name in enumerate(sources)]
    with tempfile.TemporaryDirectory() as root:
        path = write_shard_set(Path(root) / "set", rows, seq_len=8, rows_per_shard=7, rows_per_batch=rows_per_batch)
        ds = MidtrainDataset([ShardSetSpec(path, 1.0)], num_samples=len(rows), seed=3, blend_period=1,
                             window_chunks=GLOBAL, dense_attention_mask=False, cache_bytes=2048)
        plain = MidtrainDataset([ShardSetSpec(path, 1.0)], num_samples=len(rows), seed=3, blend_period=1,
                                window_chunks=GLOBAL, dense_attention_mask=False)
        got = _read(ds, GlobalOrderSampler(0, len(rows) - len(rows) % 2, 2, 1, 0), workers=0)
        names = sorted(set(sources))
        for position in range(len(rows)):
            row = int(plain[position]["row"])
            assert names[int(plain[position]["source_id"])] == sources[row]
            if position in got:
                assert names[int(got[position]["source_id"])] == sources[row]
