"""Config validation: errors name the bad key; paths resolve against the config file."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
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


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "moe_gpu.yaml", "quickstart_cpu.yaml"])
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


def test_micro_batch_of_a_million_is_refused_at_load_with_the_bound(tmp_path):
    # Was: accepted, then the trainer segfaulted.
    with pytest.raises(MidtrainConfigError) as exc:
        load_config(_write(tmp_path, _merge("train", micro_batch_size=10**6, global_batch_size=10**6)))
    assert "train.micro_batch_size: at most 4,096: sequences in one forward pass on one rank (got 1000000)" in str(exc.value)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_merge("model", seq_len=2**21), "model.seq_len: at most 1,048,576"),
        (_merge("model", vocab_size=2**23), "model.vocab_size: at most 4,194,304"),
        (_merge("model", hidden_size=2**17, num_attention_heads=4), "model.hidden_size: at most 65,536"),
        (_merge("moe", num_experts=10**4), "moe.num_experts: at most 4,096"),
        (_merge("moe", ffn_hidden_size=10**6), "moe.ffn_hidden_size: at most 65,536"),
        (_merge("moe", shared_expert_ffn_hidden_size=10**6), "moe.shared_expert_ffn_hidden_size: at most 65,536"),
        (_merge("train", global_batch_size=2**21), "train.global_batch_size: at most 1,048,576"),
        (_merge("train", seed=2**32), "train.seed: at most 2,147,483,647: numpy seeds are below 2^32"),
        (_merge("train", seed=-1), "train.seed: Input should be greater than or equal to 0"),
        (_merge("data", num_workers=1000), "data.num_workers: at most 64"),
        (_merge("data", blend_period=10**8), "data.blend_period: at most 1,000,000"),
        (_merge("data", shuffle_window_chunks=10**6), "data.shuffle_window_chunks: at most 4,096"),
        ({**_merge("model", seq_len=2**20), "train": {**BASE["train"], "micro_batch_size": 32, "global_batch_size": 64}},
         "train.micro_batch_size x model.seq_len = 33,554,432 tokens per micro batch; at most 16,777,216"),
        (_merge("optimizer", lr=float("nan")), "optimizer.lr: Input should be a finite number"),
    ],
)
def test_sizes_have_upper_bounds_that_say_why(tmp_path, data, expected):
    with pytest.raises(MidtrainConfigError) as exc:
        load_config(_write(tmp_path, data))
    assert expected in str(exc.value)


def test_a_model_no_rank_can_hold_is_refused_with_the_estimate(tmp_path):
    huge = {
        **BASE,
        "model": {**BASE["model"], "hidden_size": 16384, "num_attention_heads": 128, "num_layers": 64},
        "moe": {"num_experts": 256, "router_topk": 8, "ffn_hidden_size": 16384},
    }
    with pytest.raises(MidtrainConfigError) as exc:
        load_config(_write(tmp_path, huge))
    # per layer: attention 4 h^2 = 2^30, experts 256 x 3 x h x ffn = 3 x 2^36, router 2^22; x 64 layers, + embeddings 2^22;
    # x 16 bytes = 197,636.06 GiB. Activations: 34 x 64 tokens x h x 64 layers + fp32 logits = 2.125 GiB.
    assert "one rank needs at least 197,638.2 GiB (197,636.1 GiB weights and optimizer state, 2.1 GiB activations" in str(exc.value)
    assert "at most 1,024.0 GiB" in str(exc.value)
    spread = {**huge, "parallel": {"expert": 256, "pipeline": 64}}
    assert load_config(_write(tmp_path, spread)).parallel.expert == 256


def _rl_error(tmp_path: Path, section: str, **values) -> str:
    from ember.midtrain.config import parse_rl_config

    data = yaml.safe_load((EXAMPLES / "rl_tiny_cpu.yaml").read_text())
    data[section] = {**data[section], **values}
    with pytest.raises(MidtrainConfigError) as exc:
        parse_rl_config(data, tmp_path)
    return str(exc.value)


def test_rl_sizes_and_policy_versions_are_bounded(tmp_path):
    assert "policy version a TrainBatch or policy announcement can carry" in _rl_error(
        tmp_path, "rl", initial_policy_version=2**63 - 10, steps=100
    )
    assert "rl.updates_per_batch: at most 64" in _rl_error(tmp_path, "rl", updates_per_batch=1000)
    assert "rl.seed: at most 2,147,483,647" in _rl_error(tmp_path, "rl", seed=2**40)
    assert "rl.tis_cap: Input should be a finite number" in _rl_error(tmp_path, "rl", tis_cap=float("inf"))
    big = _rl_error(tmp_path, "moe", num_experts=4096, ffn_hidden_size=65536, router_topk=8)
    assert "one rank needs at least" in big and "weights and optimizer state)" in big


def test_rl_on_a_prefix_with_no_topics_is_one_line_before_any_rank_starts(tmp_path, kafka):
    """A typo'd topic prefix used to build the model and end in a 77-line `[rank0]:` traceback."""
    data = yaml.safe_load((EXAMPLES / "rl_tiny_cpu.yaml").read_text())
    prefix = f"typo-{uuid.uuid4().hex[:8]}"
    data["rollouts"]["topic_prefix"] = prefix
    data["run_dir"] = str(tmp_path / "run")
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run([str(Path(sys.executable).parent / "midtrain"), "rl", str(config)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "EMBER_KAFKA_BOOTSTRAP": kafka})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"topic {prefix}.train-batches does not exist" in done.stderr
    assert f"`ember rollouts topics create --prefix {prefix}`" in done.stderr
    assert "[rank" not in done.stderr and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists(), "nothing was started"


def test_yaml_off_is_the_word_off_and_boolean_fields_still_take_yes_and_no(tmp_path):
    """YAML 1.1 read an unquoted `off` as false, so `replay: off` (choices "off" | "replay") was refused."""
    from ember.midtrain.config import load_rl_config

    text = (EXAMPLES / "rl_tiny_cpu.yaml").read_text().replace("replay: replay ", "replay: off    ")
    text = text.replace("moe:\n", "moe:\n  routing_replay: yes\n", 1)
    path = tmp_path / "rl.yaml"
    path.write_text(text.replace("run_dir: ../../../runs/rl-tiny-cpu", f"run_dir: {tmp_path / 'run'}"))
    config = load_rl_config(path)
    assert config.rl.replay == "off" and config.moe.routing_replay is True
