"""`ember corpus inspect DIR` and `verify` say what a shard set holds, in tables that are never cut in a pipe."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ember.cli import app
from tests.midtrain.shardsets import packed_rows, write_shard_set

SEQ = 32


def _set(directory: Path) -> Path:
    rows = packed_rows(40, SEQ, 1, "code") + packed_rows(24, SEQ, 2, "web")
    return write_shard_set(directory, rows, seq_len=SEQ, rows_per_shard=32, rows_per_batch=16)


def test_inspect_summarises_a_shard_set_and_verify_counts_what_it_checked(tmp_path: Path) -> None:
    shards = _set(tmp_path / "shards")
    runner = CliRunner()
    summary = runner.invoke(app, ["corpus", "inspect", str(shards)])
    assert summary.exit_code == 0, summary.output
    lines = [" ".join(line.strip("│ ").split()) for line in summary.output.splitlines()]
    assert "tokenizer │ test-counting (vocab 128, uint16)" in lines
    assert "shards │ 2 (" in " ".join(lines) and "sequences │ 64" in lines
    assert any(line.startswith("source code │ ") and "documents" in line for line in lines)
    verified = runner.invoke(app, ["corpus", "verify", str(shards)])
    assert verified.exit_code == 0
    assert "(2 shards, 64 sequences," in " ".join(verified.output.split())


def test_inspect_needs_exactly_one_of_a_directory_and_locate(tmp_path: Path) -> None:
    runner = CliRunner()
    neither = runner.invoke(app, ["corpus", "inspect"])
    assert neither.exit_code == 2 and "give a directory to summarise, or --locate" in neither.output
    both = runner.invoke(app, ["corpus", "inspect", str(tmp_path), "--locate", "s.arrow", "0", "0"])
    assert both.exit_code == 2 and "one of the two" in both.output
    empty = runner.invoke(app, ["corpus", "inspect", str(tmp_path)])
    assert empty.exit_code == 2 and "holds neither a shard set (manifest.json) nor a corpus build" in " ".join(empty.output.split())
