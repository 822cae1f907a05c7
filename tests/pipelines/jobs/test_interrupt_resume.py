"""Ctrl-C and SIGTERM stop `ember corpus build` within seconds, workers and all, leaving the output as it
was; a rerun skips the phases that are complete and verified, and a resumed build is byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from rich.console import Console

from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.corpus.build import build_corpus
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.formats import write_parquet
from ember.pipelines.corpus.phases import COMPLETE_FILE, cache_root, documents_key, output_key
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE
from ember.schemas.documents import DOCUMENT_SCHEMA

from tests.pipelines.corpus_support import IN_PROCESS, file_digests, rows

REPO = Path(__file__).resolve().parents[3]
STOP_WITHIN_SECONDS = 30  # liveness bound, not a speed measurement
START_TIMEOUT_SECONDS = 400
SPLIT_WITH_WORKERS = ["--phases=split", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
"""A small input builds fused and in-process by default; these tests stop a phase of the two-job build, with
its SDK worker processes."""


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("resume-input"))


@pytest.fixture(scope="module")
def reference(sample: SampleCorpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted build of the sample, both phases run."""
    out = tmp_path_factory.mktemp("resume-reference") / "out"
    outcome = build_corpus(parse_config(sample.config(str(out))), IN_PROCESS)
    assert outcome.phases == {"documents": "ran", "output": "ran"}
    return out


def leftovers(out: Path) -> list[str]:
    """Staging directories next to the output, and partial cache entries."""
    names = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and p != cache_root(out)]
    cache = cache_root(out)
    return sorted(names + ([p.name for p in cache.iterdir() if ".partial-" in p.name] if cache.is_dir() else []))


def comparable(out: Path) -> dict[str, str]:
    """File digests, the report's line naming its own output directory (and so the report's size in the
    ownership file) and report.html (it records when and from which config file it was written) aside."""
    digests = file_digests(out)
    digests["report.md"] = (out / "report.md").read_text().replace(str(out), "<out>")
    assert digests.pop("report.html")
    ownership = json.loads((out / OWNERSHIP_FILE).read_text())
    ownership["sizes"].pop("report.md")
    ownership["sizes"].pop("report.html")
    digests[OWNERSHIP_FILE] = ownership
    return digests


class Build:
    """`ember corpus build` (or `tokenize`; this worktree's code) as a real process, its output lines collected as they come."""

    def __init__(self, config: Path, command: str = "build", options: tuple[str, ...] = ()):
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "corpus", command, str(config), *options],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"the build ended before '{text}':\n{self.output}"
            assert time.monotonic() < deadline, f"no '{text}' after {START_TIMEOUT_SECONDS} s:\n{self.output}"
            time.sleep(0.2)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self, signum: int, processes: int = 2, settle: float = 2, group: bool = False) -> tuple[int, float, list[psutil.Process]]:
        """Sends `signum` once `processes` descendants run (the job process, then SDK workers) and `settle` seconds
        more have passed - to the command's whole process group with `group`, as a terminal's Ctrl-C does, else
        to the command alone, as `kill` does; returns the exit code, the seconds to exit, and the processes it had."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while len(self.descendants()) < processes:
            assert self.process.poll() is None and time.monotonic() < deadline, self.output
            time.sleep(0.2)
        time.sleep(settle)
        tree = self.descendants()
        sent = time.monotonic()
        if group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout=STOP_WITHIN_SECONDS)
        except subprocess.TimeoutExpired:
            for p in [self.process, *tree]:
                p.kill()
            pytest.fail(f"still running {STOP_WITHIN_SECONDS} s after {signal.Signals(signum).name}:\n{self.output}")
        elapsed = time.monotonic() - sent
        self._reader.join(timeout=10)
        return code, elapsed, tree

    @property
    def output(self) -> str:
        return "".join(self.lines)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    _, still = psutil.wait_procs(processes, timeout=5)
    return [p for p in still if p.status() != psutil.STATUS_ZOMBIE]


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_keys_follow_what_each_phase_reads(sample: SampleCorpus, tmp_path: Path) -> None:
    base = parse_config(sample.config(str(tmp_path / "out")))
    raw = sample.config(str(tmp_path / "elsewhere"))
    moved = parse_config(raw)
    assert documents_key(moved) == documents_key(base) and output_key(moved, "k") == output_key(base, "k")
    stricter = parse_config({**raw, "filters": {"code": {"min_chars": 50}}})
    assert documents_key(stricter) != documents_key(base)
    assert output_key(parse_config({**raw, "dedup": {"near": False}}), "k") != output_key(base, "k")
    assert documents_key(parse_config({**raw, "dedup": {"near": False}})) == documents_key(base)
    assert output_key(base, "k") != output_key(base, "other documents")


def test_a_rerun_of_a_finished_build_skips_both_phases(sample: SampleCorpus, reference: Path) -> None:
    before = file_digests(reference)
    console = Console(record=True, width=200)
    outcome = build_corpus(parse_config(sample.config(str(reference))), IN_PROCESS, console)
    assert outcome.phases == {"documents": "skipped", "output": "skipped"}
    printed = console.export_text()
    assert "phase documents: up to date (key" in printed and "phase output: up to date (key" in printed
    assert outcome.stats["totals"]["kept"] > 0
    assert file_digests(reference) == before


def test_a_changed_filter_or_a_touched_input_reruns_the_documents_phase(sample: SampleCorpus, reference: Path,
                                                                        tmp_path: Path) -> None:
    inputs = tmp_path / "input"
    shutil.copytree(Path(sample.web_glob).parent.parent, inputs)
    config = json.loads(json.dumps(sample.config(str(tmp_path / "out"))).replace(str(Path(sample.web_glob).parent.parent), str(inputs)))
    first = build_corpus(parse_config(config), IN_PROCESS)
    assert first.phases == {"documents": "ran", "output": "ran"}
    entries = sorted(p.name for p in cache_root(tmp_path / "out").iterdir())

    os.utime(next(inputs.rglob("*.jsonl")), ns=(time.time_ns(), time.time_ns()))
    touched = build_corpus(parse_config(config), IN_PROCESS)
    assert touched.phases == {"documents": "ran", "output": "ran"}
    after_touch = sorted(p.name for p in cache_root(tmp_path / "out").iterdir())
    assert len(after_touch) == 1 and after_touch != entries, "the superseded entry is removed, the new one kept"

    config["filters"] = {"code": {"min_chars": 40}}
    stricter = build_corpus(parse_config(config), IN_PROCESS)
    assert stricter.phases == {"documents": "ran", "output": "ran"}
    assert stricter.stats["totals"]["kept"] <= first.stats["totals"]["kept"]


def test_sigterm_in_the_output_phase_stops_and_a_rerun_resumes_byte_identical(sample: SampleCorpus, reference: Path,
                                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = write_config(tmp_path / "build.yaml", sample.config(str(out)))
    build = Build(config, options=SPLIT_WITH_WORKERS)
    build.wait_for("phase output: running")
    code, elapsed, tree = build.stop(signal.SIGTERM)
    assert code == 143, build.output
    assert elapsed < STOP_WITHIN_SECONDS
    assert alive(tree) == [], f"left running: {alive(tree)}"
    assert "interrupted: SIGTERM during phase output" in build.output
    assert f"output.directory {out} was not created" in build.output
    assert "phase documents is complete in" in build.output and "resumes after it" in build.output
    assert not out.exists() and leftovers(out) == []
    entry = next(cache_root(out).iterdir())
    assert (entry / COMPLETE_FILE).is_file()

    console = Console(record=True, width=200)
    resumed = build_corpus(parse_config(sample.config(str(out))), IN_PROCESS, console)
    assert resumed.phases == {"documents": "skipped", "output": "ran"}
    assert f"phase documents: up to date (key {entry.name.removeprefix('documents-')}), skipped" in console.export_text()
    assert comparable(out) == comparable(reference)


@pytest.fixture(scope="module")
def big_sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    """Enough documents that the build is still reading and filtering when the signal comes."""
    return write_sample_corpus(tmp_path_factory.mktemp("big-input"), web_docs=3000, code_docs=1500)


def test_sigint_stops_a_running_build_and_leaves_the_previous_output(big_sample: SampleCorpus, reference: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = file_digests(out)
    config = big_sample.config(str(out))
    config["output"]["rows_per_shard"] = 1000
    build = Build(write_config(tmp_path / "build.yaml", config), options=SPLIT_WITH_WORKERS)
    build.wait_for("phase documents: running")
    code, elapsed, tree = build.stop(signal.SIGINT, group=True)
    assert code == 130, build.output
    assert elapsed < STOP_WITHIN_SECONDS
    assert len(tree) >= 2 and alive(tree) == [], f"left running: {alive(tree)}"
    assert "interrupted: SIGINT during phase documents" in build.output
    assert f"output.directory {out} holds the previous build, unchanged" in build.output
    assert "no phase completed, so a rerun starts over" in build.output
    assert "Traceback" not in build.output
    assert file_digests(out) == before
    assert leftovers(out) == []
    assert not cache_root(out).exists() or not any(cache_root(out).iterdir())


def test_sigint_stops_a_running_tokenize_job(reference: Path, hf_tokenizer_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    kept = [d for d in rows(reference, "documents") if d["source"] == "web"]
    documents = tmp_path / "documents"
    documents.mkdir()
    many = [{**d, "id": f"{d['id']}-{i}"} for i in range(400) for d in kept]  # enough to be running when stopped
    write_parquet(str(documents / "part-0.parquet"), many, DOCUMENT_SCHEMA)
    config = write_config(tmp_path / "tokenize.yaml", {
        "output_dir": str(out), "seq_len": 64, "window_documents": 8, "sequences_per_shard": 4, "rows_per_batch": 2,
        "tokenizer": {"kind": "huggingface", "path": str(hf_tokenizer_path), "eos_token": "<|endoftext|>",
                      "pad_token": "<|pad|>"},
        "sources": [{"name": "web", "path": str(documents / "*.parquet")}],
    })
    job = Build(config, command="tokenize")
    code, elapsed, tree = job.stop(signal.SIGINT, processes=1, settle=5, group=True)  # tokenize runs in-process in its job process
    assert code == 130, job.output
    assert elapsed < STOP_WITHIN_SECONDS
    assert alive(tree) == [], f"left running: {alive(tree)}"
    assert f"interrupted: SIGINT; output_dir {out} was not created; a rerun starts the tokenize job over" in job.output
    assert not out.exists() and leftovers(out) == []
