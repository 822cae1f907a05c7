import pyarrow as pa
import pyarrow.ipc as ipc
from typer.testing import CliRunner

from ember.cli import app
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, write_manifest
from ember.tokenize.shardset import file_sha256, verify_shard_set


def write_shard_set(directory, rows: int = 3, seq_len: int = 4):
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
    path = directory / "shard-00000.arrow"
    with ipc.new_file(path, table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    manifest = Manifest(
        tokenizer={"name": "test-bpe", "hash": "f" * 16, "vocab_size": 512},
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
    assert verify_shard_set(tmp_path) == []
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path)])
    assert result.exit_code == 1 and "sha256 mismatch" in " ".join(result.output.split())


def test_unfinished_directory_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["corpus", "verify", str(tmp_path)])
    assert result.exit_code == 2 and "not a finished shard set" in " ".join(result.output.split())
