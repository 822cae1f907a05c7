"""The decontamination stage inside a whole corpus build (FnApiRunner), its config checks and report section,
and the `ember corpus benchmarks fetch` / `ember corpus decontaminate` commands on RL prompt sets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to
from typer.testing import CliRunner

from ember.configs import CorpusConfigError
from ember.demo.sample_corpus import prose
from ember.pipelines.cli import app
from ember.pipelines.corpus.config import (
    CorpusSource, Decontamination, check_inputs, load_config, load_decontamination, parse_config,
)
from ember.pipelines.corpus.decontaminate import decontaminate_stage
from ember.pipelines.corpus.formats import record_to_row
from ember.pipelines.corpus.pipeline import corpus_stages
from ember.pipelines.corpus.report import read_stats, render_report
from ember.pipelines.corpus.report_html import funnel
from ember.pipelines.quality.decontamination import humaneval_records, item_of

from tests.pipelines.corpus_support import build, rows
from tests.pipelines.decontamination_cases import commented_docstring, embedded, function, humaneval_items, read, renamed, stdlib_files

WEB_FILTERS_OFF = {name: {"enabled": False} for name in ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality")}


@pytest.fixture(scope="module")
def benchmark_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = CliRunner().invoke(app, ["benchmarks", "fetch", "humaneval", "--out", str(tmp_path_factory.mktemp("bench"))])
    assert result.exit_code == 0, result.output
    return Path(result.output.split(" in ")[-1].strip())


def test_fetch_writes_humaneval_in_the_benchmark_form_and_never_overwrites(benchmark_file: Path) -> None:
    records = [json.loads(line) for line in benchmark_file.read_text().splitlines()]
    assert len(records) == 164 and records[0]["id"] == "HumanEval/0"
    assert {"id", "prompt", "solution", "tests"} <= set(records[0])
    again = CliRunner().invoke(app, ["benchmarks", "fetch", "humaneval", "--out", str(benchmark_file.parent)])
    assert again.exit_code == 2 and "already exists" in again.output
    unknown = CliRunner().invoke(app, ["benchmarks", "fetch", "mbpp", "--out", str(benchmark_file.parent)])
    assert unknown.exit_code == 2 and "available: ['humaneval']" in unknown.output


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, benchmark_file: Path) -> tuple[Path, dict]:
    """Code: 10 clean stdlib files and four contaminated ones; web: 4 clean pages and one quoting a prompt."""
    root = tmp_path_factory.mktemp("decont-corpus")
    items = {i.id: i for i in humaneval_items()}
    clean = stdlib_files(10, seed=3)
    code = [{"text": read(p), "path": p.name} for p in clean]
    code += [
        {"text": function(items["HumanEval/0"]), "path": "close.py"},
        {"text": renamed(items["HumanEval/12"]), "path": "longest.py"},
        {"text": embedded(items["HumanEval/100"], read(clean[0]), seed=1), "path": "pile.py"},
        {"text": commented_docstring(items["HumanEval/20"], "block"), "path": "closest.js"},  # a JSDoc comment
    ]
    rng = random.Random(1)
    web = [{"text": prose(rng, 10), "url": f"https://example.org/{k}"} for k in range(4)]
    web.append({"text": prose(rng, 3) + "\nHere is a task I found:\n" + items["HumanEval/5"].prompt, "url": "https://example.org/q"})
    (root / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in code))
    (root / "web.jsonl").write_text("".join(json.dumps(r) + "\n" for r in web))
    config = {
        "sources": [
            {"name": "code", "kind": "code", "inputs": [str(root / "code.jsonl")], "fields": {"metadata": {"path": "path"}}},
            {"name": "web", "kind": "web", "inputs": [str(root / "web.jsonl")], "fields": {"metadata": {"url": "url"}}},
        ],
        "filters": {"web": WEB_FILTERS_OFF, "code": {"max_line_length": None, "max_mean_line_length": None,
                                                     "min_alphanum_fraction": None, "max_encoded_fraction": None}},
        "decontamination": {"benchmarks": [{"name": "humaneval", "paths": [str(benchmark_file)]}]},
        "output": {"directory": str(root / "out")},
    }
    return root, config


@pytest.fixture(scope="module")
def built(corpus: tuple[Path, dict]) -> Path:
    root, config = corpus
    assert build(parse_config(config)) == "DONE"
    return root / "out"


def test_contaminated_documents_are_rejected_with_benchmark_and_item(built: Path) -> None:
    rejects = [r for r in rows(built, "rejects") if r["stage"] == "decontaminate"]
    found = {(r["source"], r["reason"], item_of(r["detail"])) for r in rejects}
    assert found == {
        ("code", "decontamination:humaneval", "HumanEval/0"),
        ("code", "decontamination:humaneval", "HumanEval/12"),
        ("code", "decontamination:humaneval", "HumanEval/100"),
        ("code", "decontamination:humaneval", "HumanEval/20"),
        ("web", "decontamination:humaneval", "HumanEval/5"),
    }
    kept = rows(built, "documents")
    assert not any("HumanEval" in d["text"] or "def longest" in d["text"] for d in kept)
    assert sum(d["source"] == "web" for d in kept) == 4
    stats = read_stats(str(built))
    assert stats["totals"]["balanced"]
    assert stats["totals"]["rejected_by_reason"]["decontaminate:decontamination:humaneval"] == 5
    assert stats["sources"]["code"]["stages"]["decontaminate"]["matched.renamed_ngram"] == 1


def test_the_report_has_a_section_per_benchmark(built: Path) -> None:
    report = render_report(str(built))
    section = report.split("## Decontamination", 1)[1].split("\n## ", 1)[0]
    assert "### humaneval: 5 documents removed" in section
    assert "| code | 4 |" in section and "| web | 1 |" in section
    for item in ("HumanEval/0", "HumanEval/5", "HumanEval/12", "HumanEval/20", "HumanEval/100"):
        assert f"| {item} | 1 |" in section
    steps = dict(funnel(read_stats(str(built)))["web"])
    assert list(steps) == ["in", "read", "filtered", "redacted", "decontaminated", "exact dedup", "near dedup", "written"]
    assert steps["redacted"] - steps["decontaminated"] == 1


def test_the_stage_checks_only_the_kinds_it_applies_to(benchmark_file: Path) -> None:
    items = {r["id"]: r for r in humaneval_records()}
    text = items["HumanEval/3"]["prompt"] + items["HumanEval/3"]["solution"]
    docs = []
    for kind in ("code", "web"):
        source = CorpusSource.model_validate({"name": kind, "kind": kind, "inputs": ["x"]})
        row, _ = record_to_row({"text": text}, source, f"{kind}.jsonl:line=1")
        docs.append(row)
    section = Decontamination.model_validate({"benchmarks": [{"name": "he", "paths": [str(benchmark_file)]}],
                                              "applies_to": ["code"]})
    with beam.Pipeline("FnApiRunner") as p:
        out = p | beam.Create(docs) | decontaminate_stage(section, None)
        assert_that(out.documents | beam.Map(lambda r: r["source"]), equal_to(["web"]), label="kept")
        assert_that(out.rejects | beam.Map(lambda r: (r["source"], r["reason"], item_of(r["detail"]))),
                    equal_to([("code", "decontamination:he", "HumanEval/3")]), label="rejects")


def test_the_stage_runs_after_redaction_and_before_dedup(benchmark_file: Path) -> None:
    config = {"sources": [{"name": "web", "kind": "web", "inputs": ["x"]}], "output": {"directory": "o"},
              "decontamination": {"benchmarks": [{"name": "he", "paths": [str(benchmark_file)]}]}}
    assert [s.label for s in corpus_stages(parse_config(config))] == [
        "ReadSources", "Filter", "Redact", "Decontaminate", "ExactDedup", "NearDedup"]


def test_config_errors_name_the_key_and_the_missing_file(corpus: tuple[Path, dict], tmp_path: Path) -> None:
    _, config = corpus
    missing = {**config, "decontamination": {"benchmarks": [{"name": "mbpp", "paths": [str(tmp_path / "mbpp.jsonl")]}]}}
    with pytest.raises(CorpusConfigError, match=rf"decontamination.benchmarks.0.paths.0: benchmark file '{tmp_path}/mbpp.jsonl' not found"):
        check_inputs(parse_config(missing))
    unmapped = {**config, "decontamination": {"benchmarks": [
        {"name": "gsm8k", "paths": ["g.jsonl"], "fields": {"solution": None}, "match": ["prompt", "solution"]}]}}
    with pytest.raises(CorpusConfigError, match=r"decontamination.benchmarks.0: match lists \['solution'\] but fields maps"):
        parse_config(unmapped)
    with pytest.raises(CorpusConfigError, match="decontamination.n_grams: at most 64"):
        parse_config({**config, "decontamination": {**config["decontamination"], "n_grams": 100}})
    repeated = {**config, "decontamination": {"benchmarks": [config["decontamination"]["benchmarks"][0]] * 2}}
    with pytest.raises(CorpusConfigError, match=r"benchmark names must be unique; repeated: \['humaneval'\]"):
        parse_config(repeated)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n{"oops": 2}\n')
    section = Decontamination.model_validate({"benchmarks": [{"name": "b", "paths": [str(bad)]}]})
    with pytest.raises(CorpusConfigError, match=rf"decontamination.benchmarks.0.paths.0: {bad}:2: no id field 'id'"):
        section.read_items()


def test_relative_benchmark_paths_resolve_against_the_config(tmp_path: Path, benchmark_file: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "he.jsonl").write_bytes(benchmark_file.read_bytes())
    (tmp_path / "c.yaml").write_text(json.dumps({
        "sources": [{"name": "web", "kind": "web", "inputs": ["in/*.jsonl"]}], "output": {"directory": "out"},
        "decontamination": {"benchmarks": [{"name": "he", "paths": ["sub/he.jsonl"]}]}}))
    assert load_config(str(tmp_path / "c.yaml")).decontamination.benchmarks[0].paths == [str(tmp_path / "sub" / "he.jsonl")]
    assert load_decontamination(str(tmp_path / "c.yaml")).benchmarks[0].paths == [str(tmp_path / "sub" / "he.jsonl")]


def _prompt_records() -> list[dict]:
    items = {i.id: i for i in humaneval_items()}
    return [
        {"prompt": "Write a function that returns the sum of the squares of a list of integers.", "answer": "ok"},
        {"prompt": "Solve the following:\n" + items["HumanEval/7"].prompt, "answer": "filter"},
        {"prompt": "Explain the difference between a list and a tuple in Python.", "answer": "ok"},
        {"prompt": "Fix my code:\n" + renamed(items["HumanEval/12"]), "answer": "x"},  # found by renamed n-grams only
    ]


def test_decontaminate_splits_a_jsonl_prompt_set(tmp_path: Path, benchmark_file: Path) -> None:
    records = _prompt_records()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["decontaminate", str(prompts), "--benchmark", str(benchmark_file),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "2 of 4 prompts clean" in result.output and "2 contaminated" in result.output
    clean = [json.loads(line) for line in (tmp_path / "out" / "clean.jsonl").read_text().splitlines()]
    assert clean == [records[0], records[2]]
    dirty = [json.loads(line) for line in (tmp_path / "out" / "contaminated.jsonl").read_text().splitlines()]
    assert [(d["answer"], d["decontamination"]["benchmark"], d["decontamination"]["item_id"]) for d in dirty] == [
        ("filter", "humaneval", "HumanEval/7"), ("x", "humaneval", "HumanEval/12")]
    again = CliRunner().invoke(app, ["decontaminate", str(prompts), "--benchmark", str(benchmark_file),
                                     "--out", str(tmp_path / "out")])
    assert again.exit_code == 2 and "already exist" in again.output


def test_decontaminate_a_parquet_prompt_set_with_a_config(tmp_path: Path, benchmark_file: Path) -> None:
    records = _prompt_records()
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(records), prompts)
    config = tmp_path / "decont.yaml"
    config.write_text(json.dumps({"decontamination": {"benchmarks": [{"name": "he", "paths": [str(benchmark_file)]}],
                                                      "identifiers": False}}))
    result = CliRunner().invoke(app, ["decontaminate", str(prompts), "--config", str(config), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert "3 of 4 prompts clean" in result.output  # identifiers: false, so the renamed copy passes
    assert pq.read_table(tmp_path / "o" / "clean.parquet").to_pylist() == [records[0], records[2], records[3]]
    dirty = pq.read_table(tmp_path / "o" / "contaminated.parquet").to_pylist()
    assert json.loads(dirty[0]["decontamination"])["item_id"] == "HumanEval/7"
    clean_only = tmp_path / "clean.jsonl"
    clean_only.write_text(json.dumps(records[0]) + "\n")
    ok = CliRunner().invoke(app, ["decontaminate", str(clean_only), "--config", str(config), "--out", str(tmp_path / "c")])
    assert ok.exit_code == 0 and "1 of 1 prompts clean" in ok.output


def test_decontaminate_refuses_unusable_input(tmp_path: Path, benchmark_file: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "x"}) + "\n")
    args = ["decontaminate", str(prompts), "--benchmark", str(benchmark_file), "--out", str(tmp_path / "o")]
    missing_field = CliRunner().invoke(app, args)
    assert missing_field.exit_code == 2 and "p.jsonl:1: no field 'prompt'" in missing_field.output
    neither = CliRunner().invoke(app, ["decontaminate", str(prompts), "--out", str(tmp_path / "o")])
    assert neither.exit_code == 2 and "give either --config" in neither.output
    no_section = tmp_path / "c.yaml"
    no_section.write_text("sources: []\n")
    result = CliRunner().invoke(app, ["decontaminate", str(prompts), "--config", str(no_section), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no decontamination: section" in result.output


def test_build_refuses_a_missing_benchmark_file_before_beam_starts(corpus: tuple[Path, dict], tmp_path: Path) -> None:
    _, config = corpus
    gone = tmp_path / "benchmarks" / "apps.jsonl"
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({**config, "output": {"directory": str(tmp_path / "out")},
                                "decontamination": {"benchmarks": [{"name": "apps", "paths": [str(gone)]}]}}))
    result = CliRunner().invoke(app, ["build", str(path), "--runner=FnApiRunner"])
    assert result.exit_code == 2
    assert f"decontamination.benchmarks.0.paths.0: benchmark file '{gone}' not found" in result.output
    assert not (tmp_path / "out").exists()
