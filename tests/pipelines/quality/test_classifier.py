"""The fastText quality stage: a classifier trained here on a tiny labelled set decides what a corpus build keeps,
its scores land in metadata.quality_score, and report.html draws their histogram."""

from __future__ import annotations

import json
import random

import fasttext
import pytest
import yaml
from typer.testing import CliRunner

from ember.cli import app
from ember.pipelines.quality.classifier import ClassifierError, FastTextScorer
from tests.pipelines.corpus_support import rows

GOOD = "def return import class self value result items index parse config test assert yield".split()
BAD = "buy cheap pills click here free offer winner casino deal bonus prize subscribe".split()


def text(rng: random.Random, words: list[str], n: int) -> str:
    return "\n".join(" ".join(rng.choices(words, k=8)) for _ in range(n // 8))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A two-label model trained on 200 lines, so the test knows what it should keep."""
    root = tmp_path_factory.mktemp("classifier")
    rng = random.Random(0)
    lines = [f"__label__hq {' '.join(rng.choices(GOOD, k=12))}" for _ in range(100)]
    lines += [f"__label__lq {' '.join(rng.choices(BAD, k=12))}" for _ in range(100)]
    rng.shuffle(lines)
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    model = fasttext.train_supervised(str(root / "train.txt"), epoch=10, thread=1, seed=0, verbose=0)
    model.save_model(str(root / "quality.bin"))
    return root / "quality.bin"


def test_scorer_separates_the_labels_and_refuses_a_bad_model(model_path, tmp_path):
    scorer = FastTextScorer(str(model_path), "__label__hq", 10_000)
    rng = random.Random(1)
    assert scorer.score(text(rng, GOOD, 40)) > 0.5 > scorer.score(text(rng, BAD, 40))
    assert abs(sum(scorer.scores("def return\nbuy cheap").values()) - 1) < 1e-3
    with pytest.raises(ClassifierError, match="no label '__label__edu'"):
        FastTextScorer(str(model_path), "__label__edu", 100)
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    with pytest.raises(ClassifierError, match="not a fastText model"):
        FastTextScorer(str(tmp_path / "junk.bin"), "__label__hq", 100)


def test_build_keeps_what_the_classifier_says_and_reports_the_scores(model_path, tmp_path):
    rng = random.Random(2)
    records = []
    for i in range(24):  # good, bad, and mixed documents whose verdict only the model knows
        words = GOOD if i % 3 == 0 else BAD if i % 3 == 1 else GOOD[: 4 + i % 5] + BAD[: 4 + (i * 7) % 6]
        records.append({"id": f"f{i}", "text": f"# file {i}\n{text(rng, words, 64)}", "path": f"src/f{i}.py"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "sources": [{"name": "code", "kind": "code", "inputs": ["in.jsonl"], "fields": {"id": "id", "metadata": {"path": "path"}}}],
        "filters": {"code": {"min_alphanum_fraction": None, "max_mean_line_length": None},
                    "classifier": {"model": str(model_path), "label": "__label__hq", "threshold": 0.5}},
        "dedup": {"exact": False, "near": False},
        "output": {"directory": "out"},
    }
    (tmp_path / "build.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["corpus", "build", str(tmp_path / "build.yaml")])
    assert result.exit_code == 0, result.output
    scorer = FastTextScorer(str(model_path), "__label__hq", 100_000)
    expected = {f"code:{r['id']}": scorer.score(r["text"]) for r in records}
    kept = {r["id"]: r["metadata"]["quality_score"] for r in rows(tmp_path / "out", "documents")}
    rejected = {r["document_id"]: r for r in rows(tmp_path / "out", "rejects")}
    assert set(kept) == {d for d, s in expected.items() if s >= 0.5} and kept
    assert set(rejected) == {d for d, s in expected.items() if s < 0.5} and rejected
    assert all(abs(kept[d] - expected[d]) < 1e-6 for d in kept)
    assert {r["reason"] for r in rejected.values()} == {"quality_classifier"}
    assert "__label__hq probability" in next(iter(rejected.values()))["detail"]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    bins = stats["sources"]["code"]["stages"]["quality_classifier"]
    assert sum(n for m, n in bins.items() if m.startswith("score_bin.")) == len(records)  # kept and rejected
    assert "Quality classifier score" in (tmp_path / "out" / "report.html").read_text()


def test_a_missing_model_is_a_config_error(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "def f(): return 1"}) + "\n")
    config = {"sources": [{"name": "c", "kind": "code", "inputs": ["in.jsonl"]}], "output": {"directory": "out"},
              "filters": {"classifier": {"model": "missing.bin"}}}
    (tmp_path / "build.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["corpus", "build", str(tmp_path / "build.yaml")])
    assert result.exit_code == 2 and "filters.classifier.model:" in result.output and "missing.bin" in result.output
