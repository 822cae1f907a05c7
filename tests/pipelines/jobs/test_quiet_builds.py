"""A normal `ember corpus tokenize` shows progress and the summary only; Beam's INFO and WARNING
lines - from the driver and from worker processes - land in `<output>.log`,
and on the terminal too with `--verbose`. Plus the tokenize pipeline's rejected.parquet writer.

The runs use the real CLI in a subprocess with stdout and stderr piped, so what a worker process writes
to the stderr it inherits is what the test sees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from ember.pipelines.tokenize_pipeline import write_rejects
from ember.schemas.documents import REJECTED_SCHEMA, reject_row
from tests.tokenize.support import mixed_documents, write_documents

REPO = Path(__file__).resolve().parents[3]
BEAM_INFO = re.compile(r"\bINFO\b.*apache_beam|apache_beam.*\bINFO\b|sdk_worker")
DRIVER_INFO = "Creating state cache"  # Beam's runner logs it at INFO in the driver


def tokenize(root: Path, tokenizer: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    config = {
        "output_dir": str(root / name),
        "seq_len": 128,
        "window_documents": 16,
        "sequences_per_shard": 8,
        "tokenizer": {"kind": "huggingface", "path": str(tokenizer), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "sources": [{"name": "code", "path": str(root / "code" / "*.parquet")}],
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", "from ember.cli import app; app()", "corpus", "tokenize", str(path), *extra]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900), root / f"{name}.log"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quiet")
    write_documents(root / "code" / "part-0.parquet", mixed_documents()["code"])
    return root


def test_a_normal_tokenize_with_worker_processes_shows_no_beam_logs_and_logs_them_to_the_file(
    corpus: Path, hf_tokenizer_path: Path
) -> None:
    result, log = tokenize(corpus, hf_tokenizer_path, "quiet", "--direct_num_workers=2",
                           "--direct_running_mode=multi_processing")
    assert result.returncode == 0, result.stdout + result.stderr
    for stream in (result.stdout, result.stderr):
        assert DRIVER_INFO not in stream and not BEAM_INFO.search(stream), stream
    assert result.stderr == ""
    assert "tokenize" in result.stdout and re.search(r"OK \d+ shards", result.stdout), result.stdout
    text = log.read_text()
    assert DRIVER_INFO in text and BEAM_INFO.search(text), "the driver's and the workers' logs are in the log file"
    assert "sdk_worker" in text, "a worker process's own lines reach the log file"


def test_verbose_shows_beams_logs_and_still_writes_them_to_the_file(corpus: Path, hf_tokenizer_path: Path) -> None:
    result, log = tokenize(corpus, hf_tokenizer_path, "verbose", "--verbose")
    assert result.returncode == 0, result.stdout + result.stderr
    assert DRIVER_INFO in result.stderr and BEAM_INFO.search(result.stderr), result.stderr
    assert DRIVER_INFO in log.read_text() and BEAM_INFO.search(log.read_text())


def test_rejected_parquet_holds_every_row_and_is_written_empty_when_nothing_was_rejected(tmp_path: Path) -> None:
    rows = [reject_row("web", "web/*.parquet", "tokenize", "empty_after_tokenization", "0 characters", f"d{i}")
            for i in range(5)] + [reject_row("code", "code/*.parquet", "tokenize", "missing_id", "", None)]
    counts = write_rejects(tmp_path / "rejected.parquet", iter(rows))
    assert counts == {("web", "empty_after_tokenization"): 5, ("code", "missing_id"): 1}
    table = pq.read_table(tmp_path / "rejected.parquet")
    assert table.schema.equals(REJECTED_SCHEMA, check_metadata=True) and table.to_pylist() == rows

    assert write_rejects(tmp_path / "empty.parquet", []) == {}
    empty = pq.read_table(tmp_path / "empty.parquet")
    assert empty.num_rows == 0 and empty.schema.equals(REJECTED_SCHEMA, check_metadata=True)
