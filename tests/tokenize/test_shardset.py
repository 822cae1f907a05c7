"""Shard sets against their manifests: the `verify` audit, the verified-once markers readers use, and `inspect`."""

import hashlib
import json
import multiprocessing
import os
import time

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from typer.testing import CliRunner

from ember.cli import app
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, read_manifest, write_manifest
from ember.schemas.shards import ShardEntry
from ember.tokenize.shards import ROWS_PER_BATCH_KEY
from ember.tokenize.shardset import ShardError, ShardVerifier, file_sha256, read_verified_row, verify_shard_set
from tests.tokenize.verify_worker import verify_in_process

RACY_NS = 50_000_000  # these verifiers trust a file for a marker once it has not changed for 50 ms


@pytest.fixture(autouse=True)
def marker_cache(tmp_path, monkeypatch):
    """Readers' default marker directory (`inspect` on the command line) goes to this test's tmp dir."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verified-shards"


def squeezed(text: str) -> str:
    """CLI output without whitespace: rich wraps long tmp paths anywhere."""
    return "".join(text.split())


def write_shard_set(directory, rows: int = 3, seq_len: int = 4, vocab: int = 512):
    table = pa.Table.from_pylist(
        [
            {
                "tokens": [i, i + 1, 0, 0],
                "cu_seqlens": [0, 2],
                "segments": [{"document_id": f"d{i}", "doc_token_start": 0, "doc_token_end": 2}],
                "source": "code",
                "loss_mask": None,
            }
            for i in range(rows)
        ],
        schema=PACKED_SEQUENCE_SCHEMA,
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "shard-00000.arrow"
    schema = table.schema.with_metadata({**table.schema.metadata, ROWS_PER_BATCH_KEY: str(rows).encode()})
    with ipc.new_file(path, schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    manifest = Manifest(
        tokenizer={"name": "test-bpe", "hash": "f" * 16, "vocab_size": vocab},
        seq_len=seq_len,
        dtype="uint16",
        sources={"code": {"documents": rows, "tokens": 2 * rows, "sequences": rows, "padding_tokens": 2 * rows}},
        padding_tokens=2 * rows,
        pad_token_id=0,
        shards=[{"path": path.name, "rows": rows, "bytes": path.stat().st_size, "sha256": file_sha256(path)}],
        config_hash="0123456789ab",
        created_at="2026-12-02T00:00:00Z",
    )
    write_manifest(directory, manifest)
    return path


def test_intact_shard_set_verifies(tmp_path):
    write_shard_set(tmp_path)
    assert verify_shard_set(tmp_path) == []
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path)])
    assert result.exit_code == 0, result.output


def test_changed_shard_is_reported(tmp_path):
    path = write_shard_set(tmp_path)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert verify_shard_set(tmp_path) == [
        f"shard-00000.arrow: sha256 mismatch: the file hashes to {file_sha256(path)[:16]}..., the manifest says "
        f"{read_manifest(tmp_path).shards[0].sha256[:16]}... (the file changed after the manifest was written)"
    ]
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path)])
    assert result.exit_code == 1 and "sha256 mismatch" in " ".join(result.output.split())


def test_unfinished_directory_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path)])
    assert result.exit_code == 2 and "not a finished shard set" in " ".join(result.output.split())


@pytest.mark.parametrize("outside", ["../outside.arrow", "ABSOLUTE"])
def test_verify_refuses_a_manifest_path_outside_the_set(tmp_path, outside):
    path = write_shard_set(tmp_path / "set")
    target = tmp_path / "outside.arrow"
    target.write_bytes(path.read_bytes())  # same bytes: only the path rule can refuse it
    name = str(target) if outside == "ABSOLUTE" else outside
    data = json.loads((tmp_path / "set" / "manifest.json").read_text())
    data["shards"][0]["path"] = name
    (tmp_path / "set" / "manifest.json").write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path / "set")])
    assert result.exit_code == 2
    assert squeezed(f"field 'shards.0.path': Value error, {name!r}: must be a relative name inside the shard set") in squeezed(
        result.output
    )


def write_files(directory, count: int, size: int) -> list[ShardEntry]:
    """Files with manifest entries: the verifier checks bytes only, so any content will do."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(count):
        data = os.urandom(size)
        (directory / f"shard-{i:06d}.arrow").write_bytes(data)
        entries.append(ShardEntry(path=f"shard-{i:06d}.arrow", rows=1, bytes=size, sha256=hashlib.sha256(data).hexdigest()))
    return entries


def markers(directory) -> dict[str, dict]:
    return {m["path"]: m for m in (json.loads(p.read_text()) for p in directory.glob("*.json"))}


def test_a_marker_skips_the_rehash_until_the_file_changes(tmp_path):
    entries = write_files(tmp_path / "set", 2, 4096)
    names = [e.path for e in entries]
    verifier = ShardVerifier(tmp_path / "markers", racy_ns=RACY_NS)
    # just written: a write in the same clock tick would leave mtime alone, so no marker yet
    assert verifier.check(tmp_path / "set", entries).hashed == names
    assert verifier.check(tmp_path / "set", entries).hashed == names
    assert markers(tmp_path / "markers") == {}
    time.sleep(3 * RACY_NS / 1e9)
    assert verifier.check(tmp_path / "set", entries).hashed == names
    assert verifier.check(tmp_path / "set", entries).hashed == []
    shard = (tmp_path / "set" / names[0]).resolve()
    marker = markers(tmp_path / "markers")[str(shard)]
    assert (marker["mtime_ns"], marker["size"], marker["sha256"]) == (shard.stat().st_mtime_ns, 4096, entries[0].sha256)
    os.utime(shard)  # touch: same bytes, new mtime
    time.sleep(3 * RACY_NS / 1e9)
    assert verifier.check(tmp_path / "set", entries).hashed == [names[0]]
    assert markers(tmp_path / "markers")[str(shard)]["mtime_ns"] == shard.stat().st_mtime_ns
    assert verifier.check(tmp_path / "set", entries).hashed == []


def test_a_change_that_keeps_size_and_mtime_is_still_caught(tmp_path):
    entries = write_files(tmp_path / "set", 2, 4096)
    verifier = ShardVerifier(tmp_path / "markers", racy_ns=RACY_NS)
    time.sleep(3 * RACY_NS / 1e9)
    verifier.check(tmp_path / "set", entries)
    shard = tmp_path / "set" / entries[1].path
    before = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0x10]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back, as a copy tool would
    assert (shard.stat().st_mtime_ns, shard.stat().st_size) == (before.st_mtime_ns, before.st_size)
    with pytest.raises(ShardError, match=f"{shard}: sha256 mismatch"):
        verifier.check(tmp_path / "set", entries)


def test_missing_truncated_and_wrong_hash_shards_are_all_named(tmp_path):
    entries = write_files(tmp_path / "set", 4, 4096)
    (tmp_path / "set" / entries[0].path).unlink()
    with open(tmp_path / "set" / entries[1].path, "r+b") as handle:
        handle.truncate(4000)
    entries[2] = entries[2].model_copy(update={"sha256": "0" * 64})
    verifier = ShardVerifier(tmp_path / "markers", racy_ns=RACY_NS)
    with pytest.raises(ShardError) as info:
        verifier.check(tmp_path / "set", entries)
    first, second = (tmp_path / "set" / e.path for e in entries[:2])
    assert str(info.value) == f"{first}: missing; {second}: 4000 bytes, the manifest says 4096"
    (tmp_path / "set" / entries[0].path).write_bytes(b"x")  # sizes as listed: now the hashes differ
    entries[0] = entries[0].model_copy(update={"bytes": 1})
    entries[1] = entries[1].model_copy(update={"bytes": 4000})
    with pytest.raises(ShardError) as info:
        verifier.check(tmp_path / "set", entries)
    assert [p.split(": ", 1)[0] for p in str(info.value).split("; ")] == [str(tmp_path / "set" / e.path) for e in entries[:3]]
    assert str(info.value).count("sha256 mismatch") == 3


def test_ranks_verifying_one_set_at_once_hash_each_shard_once(tmp_path):
    entries = write_files(tmp_path / "set", 8, 4 * 1024 * 1024)
    time.sleep(3 * RACY_NS / 1e9)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    args = (str(tmp_path / "set"), str(tmp_path / "markers"), RACY_NS, [e.model_dump() for e in entries], barrier, results)
    ranks = [ctx.Process(target=verify_in_process, args=args) for _ in range(3)]
    for rank in ranks:
        rank.start()
    hashed = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0
    assert sorted(p for per_rank in hashed for p in per_rank) == [e.path for e in entries]
    names = [hashlib.sha256(str((tmp_path / "set" / e.path).resolve()).encode()).hexdigest()[:40] for e in entries]
    assert sorted(os.listdir(tmp_path / "markers")) == sorted(  # complete markers only, no temporary left
        [f"{name}.json" for name in names] + [f"{name[:2]}.lock" for name in {n[:2] for n in names}]
    )
    assert {m["sha256"] for m in markers(tmp_path / "markers").values()} == {e.sha256 for e in entries}


def test_inspect_shows_a_row_of_a_verified_shard(tmp_path, marker_cache):
    path = write_shard_set(tmp_path / "set")
    result = CliRunner().invoke(app, ["corpus", "inspect", "--locate", str(path), "1", "1"])
    assert squeezed("id 2, source code") in squeezed(result.output)
    assert squeezed("document d1 token 1") in squeezed(result.output)
    # this hand-written set records no provenance, so the text itself cannot be shown: exit 1, said plainly
    assert result.exit_code == 1, result.output
    assert squeezed("the manifest records no provenance") in squeezed(result.output)


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "missing"])
def test_inspect_refuses_a_corrupt_shard(tmp_path, damage):
    path = write_shard_set(tmp_path / "set")
    data = bytearray(path.read_bytes())
    if damage == "bit flip":
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        expected = f"{path}: sha256 mismatch"
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-100]))
        expected = f"{path}: {len(data) - 100} bytes, the manifest says {len(data)}"
    else:
        path.unlink()
        expected = f"{path}: missing"
    result = CliRunner().invoke(app, ["corpus", "inspect", "--locate", str(path), "1", "1"])
    assert result.exit_code == 2
    assert squeezed(expected) in squeezed(result.output)


def test_token_ids_outside_the_vocabulary_are_refused_by_inspect_and_verify(tmp_path):
    path = write_shard_set(tmp_path / "set", vocab=2)  # row i holds tokens [i, i + 1, 0, 0]
    assert read_verified_row(path, 0)["tokens"] == [0, 1, 0, 0]
    result = CliRunner().invoke(app, ["corpus", "inspect", "--locate", str(path), "1", "0"])
    assert result.exit_code == 2
    problem = "row 1 position 1: token id 2 is outside the vocabulary (tokenizer.vocab_size 2)"
    assert squeezed(f"{path} {problem}") in squeezed(result.output)
    assert verify_shard_set(tmp_path / "set") == [f"{path.name}: {problem}"]


def test_inspect_reads_only_shards_listed_by_a_manifest(tmp_path):
    path = write_shard_set(tmp_path / "set")
    stray = tmp_path / "set" / "stray.arrow"
    stray.write_bytes(path.read_bytes())
    loose = tmp_path / "loose" / "shard.arrow"
    loose.parent.mkdir()
    loose.write_bytes(path.read_bytes())
    with pytest.raises(ShardError, match=f"{stray}: not listed in {tmp_path / 'set' / 'manifest.json'}"):
        read_verified_row(stray, 0)
    result = CliRunner().invoke(app, ["corpus", "inspect", "--locate", str(loose), "0", "0"])
    assert result.exit_code == 2 and squeezed("no manifest.json in its directory or above") in squeezed(result.output)
    with pytest.raises(ShardError, match="row 3 is out of range"):
        read_verified_row(path, 3)
