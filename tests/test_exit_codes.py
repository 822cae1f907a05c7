"""Every exit code a command documents (its --help, the README), provoked through the real executables
(`.venv/bin/ember`, `.venv/bin/midtrain`) with the cheapest input that should produce it.

Codes whose provocation takes a whole Beam build or a cluster are asserted elsewhere, through the CLI too:
- `corpus build` 0: tests/pipelines/corpus/test_line_bomb.py (subprocess, FnApiRunner).
- `corpus build` 3 for a source that kept nothing, 0 with --allow-empty-source:
  tests/pipelines/corpus/test_vanished_sources.py::test_a_source_that_keeps_nothing_fails_the_build_naming_it_and_its_reasons.
- `corpus build --strict` 3, and `corpus report` 0 on its output:
  tests/pipelines/corpus/test_outputs.py::test_a_build_that_drops_a_source_warns_strict_fails_and_beam_logs_go_to_the_log_file.
- `corpus build` 1 (the job failed): tests/pipelines/corpus/test_flink_cluster.py::test_a_stage_that_cannot_recover_fails_the_build_with_one_line_and_no_manifest.
- `corpus build` 130 / 143: tests/pipelines/corpus/test_flink_cluster.py (130), tests/pipelines/jobs/test_interrupt_resume.py (143).
- `corpus build` 2 on a bad gs:// / s3:// URL: tests/pipelines/corpus/test_urls.py::test_a_bad_url_fails_before_any_work_naming_it.
- `export megatron --strict` 3: tests/tokenize/test_megatron_documents.py::test_documents_whose_pieces_do_not_join_up_are_left_out_and_named.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.midtrain.shardsets import packed_rows, write_shard_set

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
BENCHMARK_PROMPT = 'def add_numbers(first, second):\n    """Return the sum of the first and the second number given."""\n'


@dataclass(frozen=True)
class Case:
    id: str
    argv: str  # split on spaces after `{d}` becomes the inputs' directory
    code: int
    says: str  # text the output holds, `{d}` replaced too
    one_line: bool = True  # an error: one line, no traceback

    def run(self, d: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
        program, *args = self.argv.format(d=d).split(" ")
        result = subprocess.run([str(BIN / program), *args], capture_output=True, text=True, timeout=300, cwd=d,
                                env={**os.environ, "COLUMNS": "200", **(env or {})})
        return result.returncode, result.stdout + result.stderr


DECONTAMINATE = "ember corpus decontaminate {d}/prompts/%s --out {d}/out-%s --benchmark {d}/bench.jsonl"


def _decontaminate(name: str, code: int, says: str, one_line: bool = True) -> Case:
    return Case(f"corpus decontaminate {name}", DECONTAMINATE % (name, uuid.uuid4().hex[:8]), code, says, one_line)


CASES = [
    _decontaminate("clean.jsonl", 0, "1 of 1 prompts clean", one_line=False),
    _decontaminate("dirty.jsonl", 1, "1 contaminated", one_line=False),
    _decontaminate("missing.jsonl", 2, "{d}/prompts/missing.jsonl: prompt set not found"),
    _decontaminate("deep.jsonl", 2, "{d}/prompts/deep.jsonl:2: not a JSON object: nested too deeply"),
    _decontaminate("invalid_utf8.jsonl", 2, "{d}/prompts/invalid_utf8.jsonl:2: not UTF-8 (byte 12: invalid start byte)"),
    _decontaminate("not_json.jsonl", 2, "{d}/prompts/not_json.jsonl:2: not a JSON object: Expecting value"),
    _decontaminate("array.jsonl", 2, "{d}/prompts/array.jsonl:1: expected a JSON object, got list"),
    _decontaminate("no_field.jsonl", 2, "{d}/prompts/no_field.jsonl:1: no field 'prompt'"),
    _decontaminate("list_field.jsonl", 2, "{d}/prompts/list_field.jsonl:1: field 'prompt' holds dict"),
    _decontaminate("surrogate.jsonl", 2, "{d}/prompts/surrogate.jsonl:1: field 'prompt' is not valid Unicode"),
    _decontaminate("cut.jsonl.gz", 2, "{d}/prompts/cut.jsonl.gz: unreadable after"),
    _decontaminate("long_line.jsonl.gz", 2, "{d}/prompts/long_line.jsonl.gz:2: a line of 20,971,535 bytes, more than 16,777,216"),
    _decontaminate("prompts.txt", 2, "{d}/prompts/prompts.txt: unknown benchmark file type"),
    _decontaminate("not_parquet.parquet", 2, "{d}/prompts/not_parquet.parquet: not a readable Parquet file"),
    Case("corpus decontaminate deep benchmark",
         "ember corpus decontaminate {d}/prompts/clean.jsonl --out {d}/out-deep-bench --benchmark {d}/deep_bench.jsonl", 2,
         "{d}/deep_bench.jsonl:1: not a JSON object: nested too deeply", one_line=False),  # under "benchmarks are unusable:"
    Case("corpus decontaminate missing benchmark",
         "ember corpus decontaminate {d}/prompts/clean.jsonl --out {d}/out-no-bench --benchmark {d}/nowhere.jsonl", 2,
         "{d}/nowhere.jsonl: benchmark file 'nowhere' not found", one_line=False),
    Case("corpus decontaminate out is a file",
         "ember corpus decontaminate {d}/prompts/clean.jsonl --out {d}/bench.jsonl --benchmark {d}/bench.jsonl", 2,
         "{d}/bench.jsonl: cannot write the split"),
    Case("corpus decontaminate no benchmark", "ember corpus decontaminate {d}/prompts/clean.jsonl --out {d}/out-none", 2,
         "give either --config"),
    Case("corpus build bad config", "ember corpus build {d}/bad.yaml", 2, "{d}/bad.yaml is invalid", one_line=False),
    Case("corpus tokenize bad config", "ember corpus tokenize {d}/bad.yaml", 2, "{d}/bad.yaml is invalid", one_line=False),
    Case("corpus dataflow-render bad config", "ember corpus dataflow-render {d}/bad.yaml {d}/render", 2,
         "{d}/bad.yaml is invalid", one_line=False),
    Case("corpus report no build", "ember corpus report {d}/prompts", 2, "{d}/prompts holds no finished build"),
    Case("corpus verify intact", "ember corpus verify {d}/set", 0, "every shard matches its manifest", one_line=False),
    Case("corpus verify damaged", "ember corpus verify {d}/damaged", 1, "FAIL shard-000000.arrow", one_line=False),
    Case("corpus verify missing", "ember corpus verify {d}/nowhere", 2, "{d}/nowhere"),
    Case("corpus inspect missing shard", "ember corpus inspect --locate {d}/set/shard-000009.arrow 0 0", 2,
         "{d}/set/shard-000009.arrow"),
    Case("corpus inspect no documents", "ember corpus inspect --locate {d}/set/shard-000000.arrow 0 0", 1,
         "the document's text cannot be shown", one_line=False),
    Case("corpus benchmarks fetch", "ember corpus benchmarks fetch humaneval --out {d}/fetched", 0, "164 items of humaneval",
         one_line=False),
    Case("corpus benchmarks fetch unknown", "ember corpus benchmarks fetch nosuchbench --out {d}/fetched-none", 2,
         "nosuchbench"),
    Case("export megatron", "ember export megatron {d}/set {d}/megatron/out", 0, "OK", one_line=False),
    Case("export megatron missing set", "ember export megatron {d}/nowhere {d}/megatron/none", 2, "{d}/nowhere"),
    Case("rollouts etl bad config", "ember rollouts etl {d}/bad.yaml --instance 0", 2, "{d}/bad.yaml", one_line=False),
    Case("midtrain train bad config", "midtrain train {d}/bad.yaml", 2, "{d}/bad.yaml", one_line=False),
    Case("midtrain launch bad mode", "midtrain launch {d}/bad.yaml --mode nope", 2, "--mode must be train or rl, got 'nope'"),
    Case("midtrain train missing shard set", "midtrain train {d}/no_set.yaml", 2, "{d}/nowhere does not exist"),
    Case("midtrain launch missing shard set", "midtrain launch {d}/no_set.yaml --dry-run", 2, "{d}/nowhere does not exist"),
    Case("midtrain launch layout", "midtrain launch {d}/quickstart.yaml --dry-run --procs-per-node 3", 2,
         "the requested layout cannot run this config"),
]
KAFKA_CASES = [
    Case("rollouts tail missing topic", "ember rollouts tail exit-codes-%s.rollouts --limit 1" % uuid.uuid4().hex[:8], 2,
         "does not exist"),
]


def _write_inputs(d: Path) -> None:
    bench = [{"id": "add/0", "prompt": BENCHMARK_PROMPT, "solution": "    return first + second\n"},
             {"id": "mul/1", "prompt": "def multiply_all(values):\n    \"\"\"Multiply every value in the list together.\"\"\"\n"}]
    (d / "bench.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bench))
    (d / "deep_bench.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    prompts = d / "prompts"
    prompts.mkdir()
    ok = json.dumps({"prompt": "write a short poem about rivers"}) + "\n"
    texts = {
        "clean.jsonl": ok,
        "dirty.jsonl": json.dumps({"prompt": "Complete this:\n" + BENCHMARK_PROMPT}) + "\n",
        "deep.jsonl": ok + "[" * 100_000 + "]" * 100_000 + "\n",
        "not_json.jsonl": ok + "not json\n",
        "array.jsonl": "[1, 2]\n",
        "no_field.jsonl": json.dumps({"text": "x"}) + "\n",
        "list_field.jsonl": json.dumps({"prompt": {"nested": "x"}}) + "\n",
        "surrogate.jsonl": '{"prompt": "lone \\ud800 surrogate"}\n',
        "prompts.txt": ok,
        "not_parquet.parquet": ok,
    }
    for name, text in texts.items():
        (prompts / name).write_text(text)
    (prompts / "invalid_utf8.jsonl").write_bytes(ok.encode() + b'{"prompt": "\xff"}\n')
    whole = gzip.compress(ok.encode() * 2000)
    (prompts / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with gzip.open(prompts / "long_line.jsonl.gz", "wb", compresslevel=1) as out:
        out.write(ok.encode())
        out.write(b'{"prompt": "' + b"x" * (20 * 2**20) + b'"}\n')
    (d / "bad.yaml").write_text("sources: []\nno_such_key: 1\n")
    write_shard_set(d / "set", packed_rows(8, 32, seed=1, source="code"), seq_len=32, rows_per_shard=4, rows_per_batch=2)
    shutil.copytree(d / "set", d / "damaged")
    shard = d / "damaged" / "shard-000000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (d / "megatron").mkdir()
    example = yaml.safe_load((REPO / "ember" / "midtrain" / "examples" / "tiny_cpu.yaml").read_text())
    example.update(run_dir=str(d / "run"))
    example["data"]["shard_sets"] = [{"path": str(d / "set")}]
    (d / "quickstart.yaml").write_text(yaml.safe_dump(example))
    example["data"]["shard_sets"] = [{"path": str(d / "nowhere")}]
    (d / "no_set.yaml").write_text(yaml.safe_dump(example))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("exit-codes")
    _write_inputs(d)
    return d


def _check(case: Case, d: Path, env: dict[str, str] | None = None) -> None:
    code, output = case.run(d, env)
    says = case.says.format(d=d)
    assert (code, says in " ".join(output.split())) == (case.code, True), output
    assert "Traceback" not in output, output
    if case.one_line:
        assert len(output.strip().splitlines()) == 1, output


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_documented_exit_code(case: Case, inputs: Path) -> None:
    _check(case, inputs)


@pytest.mark.parametrize("case", KAFKA_CASES, ids=[c.id for c in KAFKA_CASES])
def test_a_documented_exit_code_against_the_broker(case: Case, inputs: Path, kafka: str) -> None:
    _check(case, inputs)
