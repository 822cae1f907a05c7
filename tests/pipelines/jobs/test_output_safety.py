"""Outputs never destroy what ember did not write: refusals before any work, whole-output swaps on
rebuild, a failed rebuild that changes nothing, and no truncated file under a final name on a full disk."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember.configs import CorpusConfigError
from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.cli import app
from ember.pipelines.corpus.build import build_corpus, shards_config
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.outputs import require_empty_output
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE, OutputUnusable, files_under
from ember.pipelines.tokenize_pipeline import run as tokenize
from ember.schemas import read_manifest
from ember.tokenize.shardset import verify_shard_set

from tests.pipelines.corpus_support import IN_PROCESS, file_digests, forget_build, rows
from tests.pipelines.corpus.test_build import with_tokenize


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("safety-input"))


@pytest.fixture(scope="module")
def first_build(sample: SampleCorpus, hf_tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished build with a shard set inside its output."""
    out = tmp_path_factory.mktemp("safety-first") / "out"
    build_corpus(parse_config(with_tokenize(sample.config(str(out)), hf_tokenizer_path)), IN_PROCESS)
    return out


@pytest.fixture
def previous(first_build: Path, tmp_path: Path) -> Path:
    """A private copy of the finished build, for a test to rebuild over."""
    out = tmp_path / "out"
    shutil.copytree(first_build, out)
    return out


def settings(sample: SampleCorpus, out: Path, tokenizer: Path, **output) -> dict:
    config = with_tokenize(sample.config(str(out)), tokenizer)
    config["output"].update(output)
    return config


def staging_leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_a_rebuild_into_a_directory_with_foreign_files_is_refused_and_nothing_is_deleted(
    sample: SampleCorpus, previous: Path, hf_tokenizer_path: Path
) -> None:
    (previous / "documents" / "web" / "stale-from-an-old-run.parquet").write_bytes(b"someone's file")
    (previous / "rejects" / "notes.txt").write_text("mine")
    before = file_digests(previous)
    started = time.monotonic()
    with pytest.raises(OutputUnusable) as refused:
        build_corpus(parse_config(settings(sample, previous, hf_tokenizer_path)), IN_PROCESS)
    assert time.monotonic() - started < 10, "refused before any work"
    message = str(refused.value)
    assert "2 file(s) ember did not write" in message
    assert "documents/web/stale-from-an-old-run.parquet" in message and "rejects/notes.txt" in message
    assert "nothing was changed" in message and "Move those files away" in message
    assert file_digests(previous) == before
    assert staging_leftovers(previous) == []


def test_a_foreign_file_in_the_shard_set_stops_the_rebuild_before_the_documents_change(
    sample: SampleCorpus, previous: Path, hf_tokenizer_path: Path
) -> None:
    (previous / "shards" / "shard-000099.arrow").write_bytes(b"looks like a shard, is not ember's")
    before = file_digests(previous)
    with pytest.raises(OutputUnusable, match="shards/shard-000099.arrow"):
        build_corpus(parse_config(settings(sample, previous, hf_tokenizer_path, rows_per_shard=5)), IN_PROCESS)
    assert file_digests(previous) == before, "documents, stats and report are those of the previous build"
    assert verify_shard_set(previous / "shards") == []


def test_a_failed_rebuild_leaves_the_previous_output_intact(sample: SampleCorpus, previous: Path, hf_tokenizer_path: Path) -> None:
    before = file_digests(previous)
    config = settings(sample, previous, hf_tokenizer_path)
    config["filters"] = {"code": {"min_chars": 10**8, "max_chars": None}}
    config["sources"] = [s for s in config["sources"] if s["kind"] == "code"]
    with pytest.raises(CorpusConfigError, match="the build kept no document"):  # fails after the Beam job wrote its outputs
        build_corpus(parse_config(config), IN_PROCESS)
    assert file_digests(previous) == before
    assert staging_leftovers(previous) == []
    assert verify_shard_set(previous / "shards") == []


def test_a_rebuild_replaces_documents_and_shard_set_together(sample: SampleCorpus, previous: Path, first_build: Path,
                                                             hf_tokenizer_path: Path) -> None:
    config = settings(sample, previous, hf_tokenizer_path, rows_per_shard=5)
    config["tokenize"]["seq_len"] = 64
    outcome = build_corpus(parse_config(config), IN_PROCESS)
    assert staging_leftovers(previous) == []
    documents = sorted(p.name for p in (previous / "documents" / "web").iterdir())
    assert documents != sorted(p.name for p in (first_build / "documents" / "web").iterdir())
    assert len({name.rsplit("-of-", 1)[1] for name in documents}) == 1, f"one layout, not old parts next to new: {documents}"
    assert read_manifest(previous / "shards").seq_len == 64 and verify_shard_set(previous / "shards") == []
    assert outcome.shards is not None and outcome.shards.seq_len == 64
    assert {d["id"] for d in rows(previous, "documents")} == {d["id"] for d in rows(first_build, "documents")}
    owned = json.loads((previous / OWNERSHIP_FILE).read_text())["files"]
    assert sorted([*owned, OWNERSHIP_FILE]) == files_under(previous)
    assert f"Output: `{previous}`" in (previous / "report.md").read_text()
    staged_names = [p for p in previous.rglob("*") if p.is_file() and b".staging-" in p.read_bytes()]
    assert staged_names == [], "no output names the staging directory it was built in"
    before_again = file_digests(previous)
    forget_build(previous)
    again = build_corpus(parse_config(config), IN_PROCESS)
    assert again.phases == {"documents": "ran", "output": "ran"}
    assert again.shards.config_hash == outcome.shards.config_hash, "the random staging path is in no hash"
    timed = ("shards/manifest.json", "report.html")  # both record when they were written
    assert {k: v for k, v in file_digests(previous).items() if k not in timed} == {
        k: v for k, v in before_again.items() if k not in timed}


def test_a_shard_set_rewritten_in_place_still_counts_as_embers(sample: SampleCorpus, previous: Path, hf_tokenizer_path: Path) -> None:
    config = settings(sample, previous, hf_tokenizer_path)
    denser = parse_config({**config, "tokenize": {**config["tokenize"], "sequences_per_shard": 2}})
    tokenize(shards_config(denser), IN_PROCESS, overwrite=True)  # `ember corpus tokenize --overwrite` on <out>/shards
    listed = set(json.loads((previous / OWNERSHIP_FILE).read_text())["files"])
    assert {f for f in files_under(previous) if f.startswith("shards/")} - listed, "new shard names the list lacks"
    build_corpus(parse_config(config), IN_PROCESS)
    assert verify_shard_set(previous / "shards") == [] and read_manifest(previous / "shards").sequences_per_shard == 4


def test_a_shard_set_needs_a_directory_of_its_own(sample: SampleCorpus, tmp_path: Path, hf_tokenizer_path: Path) -> None:
    out = tmp_path / "out"
    for shards, message in ((out, "not output.directory itself"), (tmp_path, "holds output.directory")):
        config = settings(sample, out, hf_tokenizer_path)
        config["tokenize"]["output_dir"] = str(shards)
        with pytest.raises(CorpusConfigError, match=message):
            build_corpus(parse_config(config), IN_PROCESS)
    assert not out.exists()


def test_the_beam_job_itself_writes_only_into_an_empty_directory(tmp_path: Path) -> None:
    """The flex template submits the job directly (a gs:// output has no staging): it must not delete either."""
    (tmp_path / "documents").mkdir()
    (tmp_path / "documents" / "keep.parquet").write_bytes(b"not ember's")
    with pytest.raises(OutputUnusable, match=r"is not empty \(.*documents/keep.parquet\)"):
        require_empty_output(str(tmp_path))
    assert (tmp_path / "documents" / "keep.parquet").read_bytes() == b"not ember's"
    require_empty_output(str(tmp_path / "new"))


def invoke_build(config: dict, tmp_path: Path, *extra: str) -> tuple[int, str, float]:
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    result = CliRunner().invoke(app, ["build", str(path), "--runner=FnApiRunner", *extra])
    assert "\n\n" not in result.output.strip(), "one paragraph"
    return result.exit_code, " ".join(result.output.split()), time.monotonic() - started


def test_an_unwritable_output_fails_in_seconds_with_one_paragraph(sample: SampleCorpus, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("a regular file: nothing, root included, can create a directory under it")
    code, output, seconds = invoke_build(sample.config(str(blocker / "out")), tmp_path)
    assert code == 2, output
    assert f"output.directory {blocker}/out cannot be written: {blocker} is not a directory" in output
    assert "Nothing was started" in output and "Traceback" not in output and seconds < 10
    assert blocker.read_text().startswith("a regular file")


def test_an_output_short_of_free_space_fails_before_the_pipeline(sample: SampleCorpus, tmp_path: Path) -> None:
    out = tmp_path / "deep" / "out"
    code, output, seconds = invoke_build(sample.config(str(out)), tmp_path, "--min-free-mb", str(10**12))
    assert code == 2, output
    assert "MiB free, the build needs at least" in output and "--min-free-mb" in output
    assert "Traceback" not in output and seconds < 10
    assert not out.exists() and staging_leftovers(out) == []
    log = (tmp_path / "deep" / "out.log").read_text()
    assert "ERROR ember.cli:" in log and "--min-free-mb" in log, "the log it named says why the build failed"


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG like ENOSPC on a full disk
{setup}
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
try:
    {write}
except OSError as exc:
    print("failed:", exc.errno)
    sys.exit(0)
sys.exit("the write did not fail")
"""


def run_on_a_full_disk(setup: str, write: str) -> str:
    script = FULL_DISK.format(setup=textwrap.dedent(setup), write=write)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_full_disk_leaves_no_truncated_parquet_part(tmp_path: Path) -> None:
    setup = f"""
    import random
    from ember.pipelines.corpus.outputs import WriteParquetPart
    from ember.schemas.documents import REJECTED_SCHEMA
    rng = random.Random(1)
    rows = [{{"source": "web", "location": f"in.jsonl:line={{i}}", "stage": "read", "reason": "invalid_json",
             "detail": "".join(rng.choice("abcdefghij") for _ in range(200))}} for i in range(200)]
    writer = WriteParquetPart(REJECTED_SCHEMA, ("location",), None)
    writer.setup()
    path = "{tmp_path}/rejects/part-00000-of-00001.parquet"
    """
    assert "failed: 27" in run_on_a_full_disk(setup, "list(writer.process((path, rows)))")
    assert files_under(tmp_path) == [], "neither the final name nor a temporary is left"


def test_a_full_disk_leaves_no_shard_and_no_temporary(tmp_path: Path) -> None:
    setup = f"""
    import numpy as np
    from ember.tokenize.packing import PackedRow
    from ember.tokenize.shards import ShardRow, write_shard
    rng = np.random.default_rng(1)
    rows = [ShardRow(PackedRow(rng.integers(0, 2**31, 512).astype(np.uint32), np.array([0, 512], dtype=np.int32),
                               [{{"document_id": f"d{{i}}", "doc_token_start": 0, "doc_token_end": 512}}]), "web")
            for i in range(16)]
    """
    assert "failed: 27" in run_on_a_full_disk(setup, f"write_shard(Path('{tmp_path}'), 0, rows, 4)")
    assert files_under(tmp_path) == []
