"""The trainer on CPU: real megatron-core GPTModel + MoE under torchrun with gloo."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ember.demo import midtrain_stage as demo_stage
from ember.midtrain.config import load_config

from .configs import SEQ, tiny_run


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """World size 2, EP=2, alltoall dispatcher, a shared expert, 2 threads per rank: one run the tests below read."""
    config_path = tiny_run(
        tmp_path_factory.mktemp("train"), steps=5, save_interval=2, parallel={"expert": 2},
        token_dispatcher="alltoall", shared_expert_ffn_hidden_size=64,
    )
    result = subprocess.run(
        [sys.executable, "-m", "ember.midtrain.cli", "train", str(config_path), "--nproc-per-node", "2", "--threads", "2"],
        capture_output=True, text=True, timeout=480,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return config_path, result


def test_expert_parallel_two_ranks_trains_logs_and_checkpoints(two_ranks):
    """Loss falls, every global sample is trained once, routed tokens add up, and the checkpoint is the last step."""
    config_path, result = two_ranks
    config = load_config(config_path)
    records = _metrics(config.metrics_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert [i for r in records for i in r["sample_ids"]] == list(range(5 * 8))
    for r in records:
        assert r["dp_size"] == 2
        assert set(r["source_loss"]) <= {"code", "web"} and r["source_loss"]
        assert len(r["tokens_per_expert"]) == 2 and all(len(layer) == 4 for layer in r["tokens_per_expert"])
        # every token of the global batch goes to top-2 experts in each layer
        assert all(sum(layer) == 8 * SEQ * 2 for layer in r["tokens_per_expert"])
        assert r["trained_tokens"] > 0 and r["tokens_per_s"] > 0
    assert (config.checkpoint_dir / "latest").read_text() == "step_00000005"
    assert sorted(p.name for p in config.checkpoint_dir.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert config.complete_marker.exists()
    assert "CPU compatibility patches active" in result.stdout


def test_threads_flag_reaches_every_rank(two_ranks):
    config_path, result = two_ranks
    assert "[midtrain] 2 rank(s), dp 2, 2 CPU thread(s) per rank" in result.stdout
    assert {r["threads"] for r in _metrics(load_config(config_path).metrics_path)} == {2}


def test_tensorboard_events_hold_the_metrics_scalars(two_ranks):
    """Event files beside metrics.jsonl: loss, lr, per-source loss and expert load, at the same steps and values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config(two_ranks[0])
    records = _metrics(config.metrics_path)
    assert list(config.run_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(config.run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens", "step_seconds", "consumed_samples", "restart",
                "dp_size", "threads"}
    expected |= {f"source_loss/{name}" for r in records for name in r["source_loss"]}
    expected |= {f"tokens_per_expert/{layer}/{expert}" for layer in range(2) for expert in range(4)}
    assert tags == expected
    for tag, value in [("loss", lambda r: r["loss"]), ("lr", lambda r: r["lr"]),
                       ("tokens_per_expert/1/3", lambda r: r["tokens_per_expert"][1][3])]:
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [r["step"] for r in records]
        assert [e.value for e in scalars] == pytest.approx([value(r) for r in records], rel=1e-6)
    code_steps = [r["step"] for r in records if "code" in r["source_loss"]]
    assert [e.step for e in events.Scalars("source_loss/code")] == code_steps


def test_megatron_known_warnings_are_not_printed(two_ranks):
    """The ~20 deprecation / fallback warnings megatron printed per rank before the first step, and
    torchrun's OMP_NUM_THREADS banner, are gone."""
    _, result = two_ranks
    noise = re.compile(r"Warning:|deprecated|experimental|OMP_NUM_THREADS", re.IGNORECASE)
    assert [line for line in result.stderr.splitlines() if noise.search(line)] == []


def test_warning_filters_name_module_and_message():
    """A known message from another module, or another message from a known module, still shows."""
    from ember.midtrain import runtime

    def warn(message: str, module: str) -> None:
        warnings.warn_explicit(message, UserWarning, f"{module}.py", 1, module=module)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.silence_known_warnings()
        warn("full scope is deprecated. Use empty cuda_graph_modules", "megatron.core.transformer.transformer_config")
        warn("full scope is deprecated. Use empty cuda_graph_modules", "ember.elsewhere")
        warn("a new warning", "megatron.core.transformer.transformer_config")
    assert [(str(w.message), w.filename) for w in caught] == [
        ("full scope is deprecated. Use empty cuda_graph_modules", "ember.elsewhere.py"),
        ("a new warning", "megatron.core.transformer.transformer_config.py"),
    ]
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert not logger.filter(logging.LogRecord(logger.name, logging.WARNING, "x", 1, "GPTModel IS DEPRECATED. ...", (), None))
    assert logger.filter(logging.LogRecord(logger.name, logging.WARNING, "x", 1, "something else", (), None))


def test_demo_stage_trains_a_few_steps_on_a_shard_set(tmp_path):
    tiny_run(tmp_path, steps=1, save_interval=0)  # writes the shard sets; the demo sizes its own model
    rows = dict(demo_stage.run(__import__("rich.console").console.Console(quiet=True), tmp_path / "code", tmp_path / "demo"))
    losses = [float(x) for x in rows["midtrain loss per step"].split(" -> ")]
    assert len(losses) == demo_stage.DEMO_STEPS
    assert losses[-1] < losses[0]
    assert "vocab 128, seq_len 32" in rows["midtrain model"]
    assert Path(rows["midtrain checkpoint"], "latest").read_text() == f"step_{demo_stage.DEMO_STEPS:08d}"


def test_a_corrupt_shard_stops_training_with_its_name_and_no_traceback(tmp_path):
    config_path = tiny_run(tmp_path, steps=3, save_interval=3)
    shard = sorted((tmp_path / "code").glob("*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    result = subprocess.run(
        [sys.executable, "-m", "ember.midtrain.train", str(config_path)], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{shard}: sha256 mismatch" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
