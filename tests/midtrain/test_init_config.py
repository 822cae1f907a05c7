"""`midtrain init --from-shards`: the written config fits the shard sets and trains as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ember.midtrain.config import load_config
from ember.midtrain.init_config import TEMPLATE, InitError, parse_choice
from ember.schemas import read_manifest

from .shardsets import TOKENIZER, packed_rows, write_shard_set

MIDTRAIN = Path(sys.executable).parent / "midtrain"
SEQ = 32


def _midtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MIDTRAIN), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture
def sets(tmp_path: Path) -> Path:
    write_shard_set(tmp_path / "shards" / "code", packed_rows(96, SEQ, 1, "code"), seq_len=SEQ, rows_per_shard=48, rows_per_batch=16)
    write_shard_set(tmp_path / "shards" / "web", packed_rows(32, SEQ, 2, "web"), seq_len=SEQ, rows_per_shard=32, rows_per_batch=16)
    return tmp_path


def test_the_written_config_carries_the_manifests_keys_and_trains(sets: Path) -> None:
    template = yaml.safe_load(TEMPLATE.read_text())
    template["train"] = {**template["train"], "steps": 2, "save_interval": 2, "micro_batch_size": 2, "global_batch_size": 4}
    template["schedule"] = {**template["schedule"], "warmup_steps": 1, "decay_steps": 1}
    (sets / "template.yaml").write_text(yaml.safe_dump(template))
    done = _midtrain("init", "configs/run.yaml", "--from-shards", "shards/code", "--from-shards", "shards/web",
                     "--template", "template.yaml", cwd=sets)
    assert done.returncode == 0, done.stderr
    assert "next: midtrain train configs/run.yaml" in done.stdout
    cfg = load_config(sets / "configs" / "run.yaml")
    assert (cfg.model.tokenizer, cfg.model.vocab_size, cfg.model.seq_len) == (TOKENIZER["name"], TOKENIZER["vocab_size"], SEQ)
    tokens = [read_manifest(sets / "shards" / name).sources[name].tokens for name in ("code", "web")]
    shares = [round(t / sum(tokens), 6) for t in tokens]
    assert [(Path(s.path).name, s.weight) for s in cfg.data.shard_sets] == list(zip(("code", "web"), shares))
    assert (cfg.moe.num_experts, cfg.model.hidden_size) == (template["moe"]["num_experts"], template["model"]["hidden_size"])
    assert cfg.run_dir == (sets / "configs" / "runs" / "run").resolve()
    trained = _midtrain("train", "configs/run.yaml", "--threads", "1", cwd=sets)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert (cfg.run_dir / "checkpoints").is_dir()


def test_given_weights_are_kept_and_sets_for_another_model_are_refused_naming_both(sets: Path) -> None:
    done = _midtrain("init", "a.yaml", "--from-shards", "shards/code=3", "--from-shards", "shards/web=1", cwd=sets)
    assert done.returncode == 0, done.stderr
    assert [s["weight"] for s in yaml.safe_load((sets / "a.yaml").read_text())["data"]["shard_sets"]] == [3.0, 1.0]
    write_shard_set(sets / "shards" / "long", packed_rows(16, 2 * SEQ, 3, "long"), seq_len=2 * SEQ, rows_per_shard=16, rows_per_batch=16)
    refused = _midtrain("init", "b.yaml", "--from-shards", "shards/code", "--from-shards", "shards/long", cwd=sets)
    assert refused.returncode == 2
    assert "shards/long has seq_len 64 but shards/code has 32" in refused.stderr
    assert not (sets / "b.yaml").exists()
    again = _midtrain("init", "a.yaml", "--from-shards", "shards/code", cwd=sets)
    assert again.returncode == 2 and "a.yaml exists; pass --overwrite" in again.stderr
    missing = _midtrain("init", "c.yaml", "--from-shards", "shards/nothing", cwd=sets)
    assert missing.returncode == 2 and "shards/nothing does not exist" in missing.stderr


def test_a_template_that_cannot_fit_the_sets_is_named_and_nothing_is_written(sets: Path) -> None:
    template = yaml.safe_load(TEMPLATE.read_text())
    template["train"] = {**template["train"], "micro_batch_size": 3}  # global 16 is not a multiple of 3
    (sets / "bad.yaml").write_text(yaml.safe_dump(template))
    done = _midtrain("init", "out.yaml", "--from-shards", "shards/code", "--template", "bad.yaml", cwd=sets)
    assert done.returncode == 2
    assert "global_batch_size 16 is not a multiple of micro_batch_size 3" in done.stderr
    assert list(sets.glob("*out.yaml*")) == []


@pytest.mark.parametrize("value, why", [("d=x", "must be a number"), ("d=0", "positive"), ("d=-1", "positive"), ("d=inf", "positive")])
def test_a_bad_weight_is_refused(value: str, why: str) -> None:
    with pytest.raises(InitError, match=why):
        parse_choice(value)
