"""Config validation: errors name the bad key; paths resolve against the config file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ember.configs import MidtrainConfigError
from ember.midtrain.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "ember" / "midtrain" / "examples"

BASE = {
    "run_dir": "run",
    "model": {"tokenizer": "t", "vocab_size": 128, "seq_len": 32, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
    "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 128},
    "optimizer": {"lr": 1e-3},
    "data": {"shard_sets": [{"path": "shards/code"}]},
    "train": {"steps": 10, "micro_batch_size": 2, "global_batch_size": 8},
}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg" / "run.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _merge(section: str, **values) -> dict:
    return {**BASE, section: {**BASE[section], **values}}


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "moe_gpu.yaml"])
def test_examples_are_valid(name):
    config = load_config(EXAMPLES / name)
    assert config.moe.num_experts % config.parallel.expert == 0


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    config = load_config(_write(tmp_path, BASE))
    assert config.run_dir == tmp_path / "cfg" / "run"
    assert config.data.shard_sets[0].path == tmp_path / "cfg" / "shards" / "code"
    assert config.checkpoint_dir == tmp_path / "cfg" / "run" / "checkpoints"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_merge("moe", router_topkk=2), "moe.router_topkk: unknown key"),
        (_merge("moe", router_topk=8), "router_topk 8 exceeds num_experts 4"),
        (_merge("moe", expert_bias=True), "expert_bias needs router_score_function: sigmoid"),
        (_merge("moe", token_dispatcher="nccl"), "moe.token_dispatcher: Input should be 'allgather', 'alltoall' or 'flex'"),
        (_merge("model", hidden_size=66), "hidden_size 66 is not divisible by num_attention_heads 4"),
        (_merge("train", global_batch_size=7), "global_batch_size 7 is not a multiple of micro_batch_size 2"),
        (_merge("optimizer", lr=0), "optimizer.lr: Input should be greater than 0"),
        ({**BASE, "parallel": {"expert": 3}}, "parallel.expert 3 does not divide moe.num_experts 4"),
        ({**BASE, "schedule": {"warmup_steps": 6, "decay_steps": 5}}, "exceed train.steps 10"),
        ({k: v for k, v in BASE.items() if k != "model"}, "model: Field required"),
    ],
)
def test_errors_name_the_bad_key(tmp_path, data, expected):
    with pytest.raises(MidtrainConfigError) as exc:
        load_config(_write(tmp_path, data))
    assert expected in str(exc.value)
    assert "run.yaml is invalid" in str(exc.value)


def test_unreadable_files_are_reported(tmp_path):
    with pytest.raises(MidtrainConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(MidtrainConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(MidtrainConfigError, match="expected a mapping of sections"):
        load_config(bad)
