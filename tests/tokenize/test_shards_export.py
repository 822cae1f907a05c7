import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from typer.testing import CliRunner

from ember.cli import app
from ember.schemas import Manifest, SchemaValidationError, conform, write_manifest
from ember.schemas.shards import PACKED_SEQUENCE_SCHEMA, packed_sequence_issues
from ember.tokenize.megatron_export import ExportError, export_megatron
from ember.tokenize.packing import Segment, assemble, best_fit_decreasing
from ember.tokenize.shards import ShardRow, encode_shard, iter_token_batches, read_row, write_shard
from ember.tokenize.shardset import ShardVerifier, verify_shard_set

SEQ_LEN = 16


def packed_rows(seed: int, vocab: int, documents: int = 40) -> list[ShardRow]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * SEQ_LEN, size=documents).tolist()
    tokens = [rng.integers(0, vocab, size=n, dtype=np.uint32) for n in lengths]
    rows = []
    for pieces in best_fit_decreasing(lengths, SEQ_LEN).bins:
        segments = [Segment(f"doc{p.doc}", p.start, p.end, tokens[p.doc][p.start : p.end]) for p in pieces]
        rows.append(ShardRow(assemble(segments, SEQ_LEN, pad_id=vocab - 1), "code" if seed % 2 else "web"))
    return rows


def write_set(directory, rows: list[ShardRow], dtype: str, vocab: int, per_shard: int = 7):
    entries = [
        write_shard(directory, i, rows[start : start + per_shard], rows_per_batch=3)
        for i, start in enumerate(range(0, len(rows), per_shard))
    ]
    tokens = sum(int(r.row.cu_seqlens[-1]) for r in rows)
    padding = len(rows) * SEQ_LEN - tokens
    write_manifest(
        directory,
        Manifest(
            tokenizer={"name": "synthetic", "hash": "a" * 16, "vocab_size": vocab},
            seq_len=SEQ_LEN,
            dtype=dtype,
            sources={"code": {"documents": 40, "tokens": tokens, "sequences": len(rows), "padding_tokens": padding}},
            padding_tokens=padding,
            pad_token_id=vocab - 1,
            shards=entries,
            config_hash="0123456789ab",
            created_at="2026-12-02T00:00:00Z",
        ),
    )
    return entries


def test_shard_rows_round_trip_with_small_record_batches(tmp_path):
    rows = packed_rows(1, 500)
    entry = write_shard(tmp_path, 0, rows, rows_per_batch=4)
    assert encode_shard(rows, 4) == (tmp_path / entry.path).read_bytes()  # deterministic bytes
    with ipc.open_file(tmp_path / entry.path) as reader:
        assert reader.num_record_batches == -(-len(rows) // 4)
        assert conform(reader.read_all(), PACKED_SEQUENCE_SCHEMA).num_rows == len(rows)
    for index in (0, 5, len(rows) - 1):
        got = read_row(tmp_path / entry.path, index)
        assert got["tokens"] == rows[index].row.tokens.tolist()
        assert got["segments"] == rows[index].row.segments and got["source"] == rows[index].source
        assert packed_sequence_issues(np.array(got["tokens"]), np.array(got["cu_seqlens"]), got["segments"], SEQ_LEN) == []
    with pytest.raises(IndexError, match="out of range"):
        read_row(tmp_path / entry.path, len(rows))
    stacked = np.concatenate(list(iter_token_batches(tmp_path / entry.path)))
    np.testing.assert_array_equal(stacked, np.stack([r.row.tokens for r in rows]))


@pytest.mark.parametrize(("dtype", "vocab"), [("uint16", 60_000), ("uint32", 150_000)])
def test_megatron_reads_the_export_token_for_token(tmp_path, dtype, vocab):
    rows = packed_rows(2, vocab)
    (tmp_path / "set").mkdir()
    write_set(tmp_path / "set", rows, dtype, vocab)
    assert verify_shard_set(tmp_path / "set") == []
    result = CliRunner().invoke(app, ["export", "megatron", str(tmp_path / "set"), str(tmp_path / "mega" / "corpus")])
    assert result.exit_code == 0, result.output
    dataset = IndexedDataset(str(tmp_path / "mega" / "corpus"))
    assert len(dataset) == len(rows)
    assert dataset.index.dtype == (np.uint16 if dtype == "uint16" else np.int32)
    np.testing.assert_array_equal(dataset.sequence_lengths, np.full(len(rows), SEQ_LEN))
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(rows) + 1))
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(dataset[i].astype(np.int64), row.row.tokens.astype(np.int64))
    np.testing.assert_array_equal(dataset.get(3, offset=2, length=5).astype(np.int64), rows[3].row.tokens[2:7])


def test_export_refuses_a_damaged_or_unfinished_set(tmp_path):
    (tmp_path / "set").mkdir()
    entries = write_set(tmp_path / "set", packed_rows(3, 500), "uint16", 500)
    shard = tmp_path / "set" / entries[1].path
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="sha256 mismatch"):
        export_megatron(tmp_path / "set", tmp_path / "out")
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()
    result = CliRunner().invoke(app, ["export", "megatron", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "not a finished shard set" in " ".join(result.output.split())


@pytest.fixture(autouse=True)
def marker_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("outside", ["../outside.arrow", "ABSOLUTE"])
def test_export_refuses_a_manifest_path_outside_the_set(tmp_path, outside):
    (tmp_path / "set").mkdir()
    entries = write_set(tmp_path / "set", packed_rows(3, 500), "uint16", 500)
    target = tmp_path / "outside.arrow"
    (tmp_path / "set" / entries[0].path).rename(target)  # the right bytes, outside the set
    name = str(target) if outside == "ABSOLUTE" else outside
    data = json.loads((tmp_path / "set" / "manifest.json").read_text())
    data["shards"][0]["path"] = name
    (tmp_path / "set" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(SchemaValidationError, match="must be a relative name inside the shard set"):
        export_megatron(tmp_path / "set", tmp_path / "out")
    result = CliRunner().invoke(app, ["export", "megatron", str(tmp_path / "set"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "shards.0.path" in result.output
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


def test_export_refuses_token_ids_outside_the_vocabulary(tmp_path):
    (tmp_path / "set").mkdir()
    rows = packed_rows(3, 500)
    write_set(tmp_path / "set", rows, "uint16", 300)  # ids up to 499 under a manifest that says 300
    tokens = np.stack([r.row.tokens for r in rows])
    row, position = np.argwhere(tokens >= 300)[0]
    shard = tmp_path / "set" / f"shard-{row // 7:06d}.arrow"
    message = f"{shard} row {row % 7} position {position}: token id {tokens[row, position]} is outside the vocabulary"
    with pytest.raises(ExportError, match=message):
        export_megatron(tmp_path / "set", tmp_path / "out")
    assert list(tmp_path.glob("*out*")) == []
    write_set(tmp_path / "set", rows, "uint32", 2**31 + 1)  # ids fit, but not every id of that vocabulary
    with pytest.raises(ExportError, match="vocab_size 2147483649 does not fit Megatron's int32"):
        export_megatron(tmp_path / "set", tmp_path / "out")


def test_export_checks_each_shard_once_per_version(tmp_path):
    (tmp_path / "set").mkdir()
    entries = write_set(tmp_path / "set", packed_rows(3, 500), "uint16", 500)
    verifier = ShardVerifier(tmp_path / "markers", racy_ns=50_000_000)
    time.sleep(0.15)
    export_megatron(tmp_path / "set", tmp_path / "a", verifier)
    assert verifier.check(tmp_path / "set", entries).hashed == []  # the export left markers
    shard = tmp_path / "set" / entries[0].path
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=f"{shard}: sha256 mismatch"):
        export_megatron(tmp_path / "set", tmp_path / "b", verifier)


REPO = Path(__file__).resolve().parents[2]
# What importing megatron-core without Transformer Engine does (a UserWarning per module, log lines), done here
# inside the export itself so that it happens while the command runs whatever is installed.
NOISY_EXPORT = """
import logging, warnings
import ember.tokenize.megatron_export as megatron_export
real = megatron_export.export_megatron
def export_megatron(*args, **kwargs):
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
    logging.getLogger("megatron.core.optimizer").warning("megatron-core log chatter")
    return real(*args, **kwargs)
megatron_export.export_megatron = export_megatron
from ember.cli import app
app()
"""


def ember(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`ember ARGS` in a fresh interpreter (warnings shown as a terminal shows them), or `python -c CODE ARGS`."""
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "ember.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}  # wide: rich would wrap the paths
    return subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_export_prints_its_result_line_and_nothing_else(tmp_path):
    (tmp_path / "set").mkdir()
    rows = packed_rows(2, 500)
    write_set(tmp_path / "set", rows, "uint16", 500)
    out = tmp_path / "mega" / "corpus"
    result = ember("export", "megatron", str(tmp_path / "set"), str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"OK {len(rows)} sequences, {len(rows) * SEQ_LEN} tokens -> {out}.bin, {out}.idx\n"
    assert result.stderr == ""


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_third_party_warnings_and_logs_show_only_with_verbose(tmp_path, verbose):
    (tmp_path / "set").mkdir()
    write_set(tmp_path / "set", packed_rows(2, 500), "uint16", 500)
    flags = ["--verbose"] if verbose else []
    result = ember("export", "megatron", *flags, str(tmp_path / "set"), str(tmp_path / "out"), code=NOISY_EXPORT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK ") and result.stdout.count("\n") == 1
    if verbose:
        assert "UserWarning: Transformer Engine and Apex are not installed" in result.stderr
        assert "megatron-core log chatter" in result.stderr
    else:
        assert result.stderr == ""
