"""The trainer on CPU: real megatron-core GPTModel + MoE under torchrun with gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ember.demo import midtrain_stage as demo_stage
from ember.midtrain.config import load_config

from .configs import SEQ, tiny_run


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_expert_parallel_two_ranks_trains_logs_and_checkpoints(tmp_path):
    """World size 2, EP=2, alltoall dispatcher, a shared expert: loss falls, every global sample is
    trained once, routed tokens add up, and the checkpoint is the last step."""
    config_path = tiny_run(
        tmp_path, steps=5, save_interval=2, parallel={"expert": 2},
        token_dispatcher="alltoall", shared_expert_ffn_hidden_size=64,
    )
    result = subprocess.run(
        [sys.executable, "-m", "ember.midtrain.cli", "train", str(config_path), "--nproc-per-node", "2"],
        capture_output=True, text=True, timeout=480,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
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


def test_demo_stage_trains_a_few_steps_on_a_shard_set(tmp_path):
    tiny_run(tmp_path, steps=1, save_interval=0)  # writes the shard sets; the demo sizes its own model
    rows = dict(demo_stage.run(__import__("rich.console").console.Console(quiet=True), tmp_path / "code", tmp_path / "demo"))
    losses = [float(x) for x in rows["midtrain loss per step"].split(" -> ")]
    assert len(losses) == demo_stage.DEMO_STEPS
    assert losses[-1] < losses[0]
    assert "vocab 128, seq_len 32" in rows["midtrain model"]
    assert Path(rows["midtrain checkpoint"], "latest").read_text() == f"step_{demo_stage.DEMO_STEPS:08d}"
