"""What an operator sees from `ember corpus build`/`inspect`: licence defaults that fit a code corpus, a
loud warning (and `--strict`) when one reason drops most of a source, a quiet terminal whose lines fit
100 columns with Beam's logs in `<output>.log`, and `inspect --locate` down to the source and its text.

The builds run the real CLI in a subprocess with stdout piped (not a terminal, as in CI), so the Beam
worker processes' own stderr is what the test sees."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import polars as pl
import pytest
import yaml
from tokenizers import Tokenizer as HFTokenizer
from typer.testing import CliRunner

from ember.pipelines.cli import app
from ember.pipelines.quality.code_filters import check_code
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.report import source_warnings
from ember.pipelines.jobs.logs import job_logs, log_path_for
from ember.pipelines.locate import locate_text
from ember.schemas.shards import read_manifest
from ember.tokenize.packing import locate as locate_token
from ember.tokenize.shards import read_row

WORDS = "def return import class self value data item index result total count name".split()
REPO = Path(__file__).resolve().parents[3]
BEAM_NOISE = ("INFO:", "WARNING:", "statecache", "sdk_worker", "grpc")
DRIVER_INFO = "Creating state cache"  # Beam's runner logs it at INFO in the driver


def stdlib_like(directory: Path, licence: str, files: int = 8) -> Path:
    """`files` distinct Python modules as JSONL records with a path and a licence (the first one MIT)."""
    rng = random.Random(7)
    directory.mkdir(parents=True)
    with open(directory / "stdlib.jsonl", "w") as f:
        for i in range(files):
            body = "\n".join(
                f"def f_{i}_{j}(x):\n    return x + {rng.randint(0, 999)}  # " + " ".join(rng.choice(WORDS) for _ in range(8))
                for j in range(6)
            )
            f.write(json.dumps({"text": body + "\n", "path": f"Lib/mod{i}.py", "license": licence if i else "MIT"}) + "\n")
    return directory


def write_config(root: Path, inputs: Path, extra: dict | None = None) -> Path:
    config = {
        "sources": [{"name": "stdlib", "kind": "code", "inputs": [f"{inputs}/*.jsonl"], "format": "jsonl",
                     "fields": {"text": "text", "metadata": {"path": "path", "license": "license"}}}],
        "output": {"directory": str(root / "out")},
        **(extra or {}),
    }
    path = root / "corpus.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ember(*args: str) -> subprocess.CompletedProcess:
    """The `ember` command of this checkout, stdout and stderr piped."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}  # a wide terminal: the output still keeps to 100 columns
    command = [sys.executable, "-c", "from ember.cli import app; app()", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def test_the_default_licence_list_keeps_psf_and_mpl() -> None:
    config = parse_config({"sources": [{"name": "c", "kind": "code", "inputs": ["x"]}], "output": {"directory": "o"}})
    for licence in ("psf-2.0", "python-2.0", "mpl-2.0", "mit", "apache-2.0", "bsd-3-clause"):
        assert check_code("def f(x):\n    return x + 1\n" * 3, {"license": licence, "path": "a.py"}, config.filters.code)[0] == ""
        assert licence in config.dedup.permissive_licenses
    assert check_code("def f(x):\n    return x\n" * 3, {"license": "gpl-3.0"}, config.filters.code)[0] == "license_not_allowed"
    assert config.warn_share == 0.5


def test_a_reason_above_the_warn_share_names_source_share_and_fix() -> None:
    stats = {"sources": {"stdlib": {"docs_in": 10, "rejected": {"filter:license_not_allowed": 6, "filter:too_short": 1}},
                         "web": {"docs_in": 10, "rejected": {"filter:too_short": 5}}}}
    rejects = pl.DataFrame({"source": ["stdlib"] * 6 + ["web"], "reason": ["license_not_allowed"] * 6 + ["too_short"],
                            "detail": ["license 'psf-2.0'"] * 4 + ["license 'lgpl-2.1'"] * 2 + ["12 chars"]}).lazy()
    [warning] = source_warnings(stats, lambda: rejects, 0.5)  # web's 50% is not more than half
    message = warning.message()
    assert "'stdlib'" in message and "filter:license_not_allowed" in message and "(60%)" in message
    assert "psf-2.0 (4), lgpl-2.1 (2)" in message and "[psf-2.0, lgpl-2.1] to filters.code.licenses" in message
    assert [w.source for w in source_warnings(stats, lambda: rejects, 0.4)] == ["stdlib", "web"]


def test_a_build_that_drops_a_source_warns_strict_fails_and_beam_logs_go_to_the_log_file(tmp_path: Path) -> None:
    config = write_config(tmp_path, stdlib_like(tmp_path / "in", "LGPL-2.1"))
    result = ember("corpus", "build", str(config), "--strict", "--direct_running_mode=multi_processing",
                   "--direct_num_workers=2")  # the multi-process runner (a small input runs in-process by default): worker processes
    assert result.returncode == 3, result.stdout + result.stderr
    out = result.stdout
    assert "warning: source 'stdlib': filter:license_not_allowed rejected 7 of 8 documents (88%)" in " ".join(out.split())
    assert "lgpl-2.1 (7)" in out and "filters.code.licenses" in out and "--strict" in out
    assert (tmp_path / "out" / "stats.json").exists(), "the output is written before the strict exit"
    for noise in BEAM_NOISE:
        assert noise not in out and noise not in result.stderr, noise
    too_wide = [line for line in out.splitlines() if len(line) > 100]
    assert not too_wide, too_wide
    assert "corpus build summary" in out and "write" in out and "docs" in out  # plain progress lines, then the summary
    log = (tmp_path / "out.log").read_text()
    assert DRIVER_INFO in log and "sdk_worker" in log, "driver and worker logs are in the log file"
    assert f"log: {tmp_path / 'out.log'}" in out

    report = ember("corpus", "report", str(tmp_path / "out"))  # e.g. after a Dataflow job: the same warning, no noise
    assert report.returncode == 0 and report.stderr == "", report.stderr
    assert "lgpl-2.1 (7)" in report.stdout and all(len(line) <= 100 for line in report.stdout.splitlines())


@pytest.fixture(scope="module")
def verbose_build(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("verbose")
    tokenize = {"tokenize": {
        "seq_len": 64, "window_documents": 8, "sequences_per_shard": 4, "rows_per_batch": 2, "seed": 3,
        "tokenizer": {"kind": "huggingface", "path": str(hf_tokenizer_path), "eos_token": "<|endoftext|>",
                      "pad_token": "<|pad|>"},
    }}
    config = write_config(root, stdlib_like(root / "in", "PSF-2.0"), tokenize)
    return root, ember("corpus", "build", str(config), "--verbose", "--strict", "--runner=FnApiRunner")


def test_psf_sources_pass_by_default_and_verbose_shows_beams_logs(verbose_build) -> None:
    root, result = verbose_build
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning:" not in result.stdout
    assert json.loads((root / "out" / "stats.json").read_text())["totals"]["kept"] == 8
    assert DRIVER_INFO in result.stderr and "INFO" in result.stderr
    assert DRIVER_INFO in (root / "out.log").read_text()
    assert "tokenize" in result.stdout and "8 of 8 docs" in " ".join(result.stdout.split())


def test_locate_prints_the_source_path_and_the_stored_text_around_the_token(verbose_build, hf_tokenizer_path: Path) -> None:
    root, result = verbose_build
    assert result.returncode == 0, result.stdout + result.stderr
    shards = root / "out" / "shards"
    shard = shards / read_manifest(shards).shards[0].path
    record = read_row(shard, 0)
    token = int(record["cu_seqlens"][1]) // 2  # inside the row's first document
    segment, index = locate_token(record["cu_seqlens"], record["segments"], token)

    where = locate_text(shard, record["source"], segment["document_id"], index, window=40)
    documents = {d["id"]: d for d in pl.read_parquet(root / "out" / "documents" / "stdlib" / "*.parquet").to_dicts()}
    document = documents[segment["document_id"]]
    start, end = where.span
    assert document["text"][start:end] == where.token_text == HFTokenizer.from_file(str(hf_tokenizer_path)).decode(
        [record["tokens"][token]])
    assert where.before == document["text"][max(0, start - 40):start] and where.after == document["text"][end:end + 40]
    assert where.origin == document["metadata"]["path"]

    shown = CliRunner().invoke(app, ["inspect", "--locate", str(shard), "0", str(token), "--window", "40"])
    assert shown.exit_code == 0, shown.output
    assert f"from {document['metadata']['path']}" in shown.output
    assert f"characters [{start}, {end})" in shown.output
    assert where.before.splitlines()[-1] + where.token_text in shown.output


def test_the_log_keeps_lines_from_before_it_was_named_and_finds_a_place_when_beside_the_output_is_unwritable(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with job_logs() as logs:
        os.write(2, b"early worker line\n")
        logging.getLogger("apache_beam.runners").info("driver info")
        path = logs.write_to(log_path_for(str(blocker / f"out-{uuid.uuid4().hex}")))
        os.write(2, b"late worker line\n")
    assert path.parent == Path(tempfile.gettempdir())
    text = path.read_text()
    path.unlink()
    assert "early worker line" in text and "apache_beam.runners: driver info" in text and "late worker line" in text
