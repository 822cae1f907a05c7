"""A source whose every document is rejected fails the build (exit 3) and says why, first, everywhere an operator
looks: the terminal and report.md's first line; the manifest gives each source's realised weight beside its
configured one; `--allow-empty-source` accepts it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ember.pipelines.corpus.report import vanished_sources
from ember.schemas.shards import read_manifest

from .test_outputs import ember, stdlib_like

FIELDS = {"text": "text", "metadata": {"path": "path", "license": "license"}}


def _gpl_only(directory: Path) -> Path:
    directory.mkdir(parents=True)
    with open(directory / "gpl.jsonl", "w") as f:
        for i in range(5):
            text = "".join(f"def g_{i}_{j}(x):\n    return x * {j} + {i}  # scaled value\n" for j in range(6))
            f.write(json.dumps({"text": text, "path": f"src/g{i}.py", "license": "GPL-3.0"}) + "\n")
    return directory


def test_a_source_that_keeps_nothing_fails_the_build_naming_it_and_its_reasons(tmp_path: Path, hf_tokenizer_path: Path) -> None:
    config = {
        "sources": [
            {"name": "stdlib", "kind": "code", "inputs": [f"{stdlib_like(tmp_path / 'in', 'PSF-2.0')}/*.jsonl"],
             "fields": FIELDS, "weight": 0.7},
            {"name": "gpl", "kind": "code", "inputs": [f"{_gpl_only(tmp_path / 'gpl')}/*.jsonl"], "fields": FIELDS,
             "weight": 0.3},
        ],
        "output": {"directory": str(tmp_path / "out")},
        "tokenize": {
            "seq_len": 64, "window_documents": 8, "sequences_per_shard": 4, "rows_per_batch": 2,
            "tokenizer": {"kind": "huggingface", "path": str(hf_tokenizer_path), "eos_token": "<|endoftext|>",
                          "pad_token": "<|pad|>"},
        },
    }
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump(config))

    failed = ember("corpus", "build", str(path), "--runner=FnApiRunner")
    assert failed.returncode == 3, failed.stdout + failed.stderr
    line = "vanished: source 'gpl' kept 0 of 5 documents; rejected by filter:license_not_allowed 5 (100%)"
    assert line in " ".join(failed.stdout.split())
    assert "source 'gpl' vanished from the output" in failed.stdout and "--allow-empty-source" in failed.stdout
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.splitlines()[0] == f"**Vanished: {line.removeprefix('vanished: ')}.**"
    manifest = read_manifest(tmp_path / "out" / "shards")
    assert list(manifest.sources) == ["stdlib"], "a source with no document has no shard rows"
    assert (manifest.sources["stdlib"].mixture_weight, manifest.sources["stdlib"].realised_weight) == (0.7, 1.0)

    reported = ember("corpus", "report", str(tmp_path / "out"))  # rewrites report.md and report.html in place
    assert reported.returncode == 0 and "vanished: source 'gpl'" in " ".join(reported.stdout.split())
    accepted = ember("corpus", "build", str(path), "--allow-empty-source", "--runner=FnApiRunner")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "up to date" in accepted.stdout and line in " ".join(accepted.stdout.split())

    inspected = ember("corpus", "inspect", str(tmp_path / "out"))
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    assert "corpus build summary" in inspected.stdout and "shard set" in inspected.stdout
    assert "…" not in inspected.stdout, "no table cell is cut"


def test_the_floor_counts_a_source_that_keeps_too_little_and_an_empty_source() -> None:
    stats = {"sources": {
        "web": {"docs_in": 120, "kept": 6, "rejected": {"filter:gopher_alpha": 69, "filter:repetition": 45}},
        "code": {"docs_in": 10, "kept": 9, "rejected": {"filter:too_short": 1}},
        "empty": {"docs_in": 0, "kept": 0, "rejected": {}},
    }}
    assert [v.source for v in vanished_sources(stats, 0.0)] == ["empty"]
    web, empty = vanished_sources(stats, 0.1)
    assert web.message() == (
        "source 'web' kept 6 of 120 documents; rejected by filter:gopher_alpha 69 (57%), filter:repetition 45 (38%)"
    )
    assert empty.message() == "source 'empty' read no documents: its inputs hold none"
    assert [v.source for v in vanished_sources(stats, 0.95)] == ["web", "code", "empty"]
