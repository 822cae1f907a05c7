"""`midtrain rl` on CPU against the real broker: router replay, mismatch reporting, the toy task, crash resume
(kill -9 of one of two ranks: both restart from the checkpoint; the single-rank case is the same path).

Megatron-core keeps global parallel state, so every trainer or sampler runs in a subprocess.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.records import PolicyVersion
from ember.rollouts.topics import Topics
from ember.schemas import decode_train_batch
from tests.rollouts.etl_support import read_topic

from .rl_support import etl_config, rl_config, trainer_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GROUPS = 6


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ember.midtrain.cli", "rl", str(config)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def batches(kafka, tmp_path_factory, sampled_policy):
    """Rollouts sampled by the tiny policy with perturbed router weights (the session's shared sample), published
    as a sampler fleet does, through the ETL into batches."""
    from ember.demo.sampler import publish

    root = tmp_path_factory.mktemp("rl")
    prefix = f"test-rl-{uuid.uuid4().hex[:8]}"
    etl = etl_config(prefix, token_budget=64)
    prepare_topics(etl, create=True)
    publish(prefix, *sampled_policy.records(GROUPS))
    EtlService(etl, "rl-test").run(until_idle_s=2.0)
    ids = [decode_train_batch(r.value).batch_id for r in read_topic(Topics(prefix).train_batches)]
    assert len(ids) == GROUPS  # one group of 4 rollouts per 64-token batch
    return root, prefix, sampled_policy.init_checkpoint, ids


def test_replay_forces_the_sampler_routing_and_off_reports_the_mismatch(batches):
    root, prefix, init, ids = batches
    runs = {
        mode: _run(trainer_config(root, mode, prefix, init, replay=mode, steps=3, correction="mis"))
        for mode in ("replay", "off")
    }
    outputs = {mode: _finish(proc) for mode, proc in runs.items()}
    replay, off = (_records(root / mode / "metrics.jsonl") for mode in ("replay", "off"))
    assert [r["batch_id"] for r in replay] == [r["batch_id"] for r in off] == ids[:3]
    for r in replay:
        assert r["replayed"] and r["routing_disagreement_per_layer"] == [0.0, 0.0], "every token, every layer"
    for r in off:
        assert not r["replayed"] and r["routing_disagreement"] > 0
    # same weights, same first batch: forcing the sampler's experts removes most of the log-prob gap
    assert off[0]["mismatch"]["mean_abs_delta_logp"] > replay[0]["mismatch"]["mean_abs_delta_logp"] > 0
    assert off[0]["mismatch"]["kl_mu_pi"] > 0 and 0 <= off[0]["correction_kept_frac"] <= 1
    for r in replay + off:  # item 4 per step: both KL estimators and the importance weights' distribution
        m = r["mismatch"]
        assert 0 < m["rho_min"] <= m["rho_mean"] <= m["rho_max"] and 0 <= m["frac_above_cap"] <= 1 and 0 <= m["frac_outside"] <= 1
        assert m["max_abs_delta_logp"] == pytest.approx(max(-math.log(m["rho_min"]), math.log(m["rho_max"])), rel=1e-6)
        assert math.isfinite(m["kl_k1"]) and m["kl_mu_pi"] >= 0
        # MIS (this run's correction) keeps exactly the tokens inside [alpha, beta]
        assert r["correction_kept_frac"] == pytest.approx(1 - m["frac_outside"], abs=1e-9)
    assert "routing-disagree" in outputs["off"] and "|dlogp|" in outputs["off"]
    versions = [PolicyVersion.decode(r.value).policy_version for r in read_topic(Topics(prefix).policy_versions)]
    assert sorted(versions) == [0, 0, 1, 1, 2, 2, 3, 3], "each run: its start, then every checkpoint"
    assert (root / "replay" / "checkpoints" / "latest").read_text() == "step_00000003"
    assert (root / "replay" / "COMPLETE").read_text() == "3\n"
    # TensorBoard events beside metrics.jsonl carry the mismatch metrics at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "off"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"mismatch/{key}" for key in off[0]["mismatch"]} | {"loss", "clip_frac", "routing_disagreement"} <= tags
    assert "routing_disagreement_per_layer/1" in tags and not any(t.startswith(("batch_id", "replayed")) for t in tags)
    kl = events.Scalars("mismatch/kl_mu_pi")
    assert [e.step for e in kl] == [r["step"] for r in off]
    assert [e.value for e in kl] == pytest.approx([r["mismatch"]["kl_mu_pi"] for r in off], rel=1e-6)
    for key in ("kl_k1", "rho_max", "frac_above_cap"):
        assert [e.value for e in events.Scalars(f"mismatch/{key}")] == pytest.approx([r["mismatch"][key] for r in off], rel=1e-6)


def _wait_records(metrics: Path, count: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while len([r for r in _records(metrics) if "event" not in r]) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the trainers died or stalled before step {count}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def test_kill_9_of_one_rank_restarts_both_from_the_checkpoint_and_trains_every_batch_once(batches):
    """`midtrain rl --nproc-per-node 2 --max-restarts 1`; rank 1 dies by SIGKILL after step 3 (checkpoint at 2):
    torchrun restarts both, they resume from step 2 and train each batch exactly once after it."""
    import psutil

    from .rl_support import BatchFeed

    root, prefix, init, ids = batches
    values = [r.value for r in read_topic(Topics(prefix).train_batches)]
    own = f"{prefix}-ranks"
    feed = BatchFeed(own)
    config = trainer_config(root, "crash-ranks", own, init, save_interval=2, correction="tis", steps=len(ids))
    data = yaml.safe_load(config.read_text())
    data["rollouts"]["idle_timeout_s"] = 120
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    metrics, log = root / "crash-ranks" / "metrics.jsonl", root / "crash-ranks.log"
    # A log file, not a pipe: the killed rank's orphaned checkpoint-writer helper would hold a pipe open.
    with open(log, "w") as out_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ember.midtrain.cli", "rl", str(config), "--nproc-per-node", "2", "--max-restarts", "1",
             "--threads", "1"],
            cwd=REPO, stdout=out_file, stderr=subprocess.STDOUT,
        )
    killed: list[psutil.Process] = []
    try:
        feed.send(values[:3])  # the trainers cannot run past step 3 before the kill
        _wait_records(metrics, 3, proc, log)
        ranks = {int(p.environ()["LOCAL_RANK"]): p for p in psutil.Process(proc.pid).children()}
        killed = ranks[1].children(recursive=True)
        ranks[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 180
        while not any(r.get("event") == "resumed" for r in _records(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        feed.send(values[3:])
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        feed.close()
        if proc.poll() is None:
            proc.kill()
        for orphan in killed:  # the dead rank's helpers outlive it
            if orphan.is_running():
                orphan.kill()
    out = log.read_text()
    records = _records(metrics)
    resumed = [i for i, r in enumerate(records) if r.get("event") == "resumed"]
    assert len(resumed) == 1 and records[resumed[0]]["step"] == 2, out[-3000:]
    lineage = [r for r in records[: resumed[0]] if r["step"] <= 2] + records[resumed[0] + 1 :]
    assert [r["step"] for r in lineage] == list(range(1, len(ids) + 1))
    assert [r["batch_id"] for r in lineage] == ids, "every batch trained once after the restart, none skipped"
    assert all(r["ranks"] == 2 and r["rank_sequences"] == [2, 2] for r in lineage)
    assert (root / "crash-ranks" / "COMPLETE").read_text() == f"{len(ids)}\n"


def test_toy_verifiable_task_mean_reward_increases(kafka, tmp_path):
    prefix = f"test-rl-toy-{uuid.uuid4().hex[:8]}"
    config = rl_config(tmp_path / "toy.yaml", tmp_path / "toy", prefix, correction="none", save_interval=0)
    out = tmp_path / "toy.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.midtrain.rl_support", "toy", str(config), "5", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(out.read_text())
    rewards = found["mean_reward"]
    assert len(found["batches"]) == len(set(found["batches"])) >= 5
    assert rewards[-1] >= rewards[0] + 0.3 and max(rewards[:2]) < rewards[-1], rewards


def test_example_config_loads_errors_name_the_key_and_launch_renders_rl(tmp_path):
    from typer.testing import CliRunner

    from ember.midtrain.cli import app
    from ember.configs import MidtrainConfigError
    from ember.midtrain.config import load_rl_config, parse_rl_config

    example = REPO / "ember" / "midtrain" / "examples" / "rl_tiny_cpu.yaml"
    config = load_rl_config(example)
    assert config.rl.replay == "replay" and config.rollouts.batches_topic == Topics("ember").train_batches
    data = yaml.safe_load(example.read_text())
    data["rl"] = {**data["rl"], "correction": "clip", "alpha": 3.0}
    with pytest.raises(MidtrainConfigError) as info:
        parse_rl_config(data, tmp_path)
    assert "rl.correction" in str(info.value)
    data["rl"]["correction"] = "mis"
    with pytest.raises(MidtrainConfigError, match="alpha 3.0 must be below beta 2.0"):
        parse_rl_config(data, tmp_path)
    result = CliRunner().invoke(app, ["launch", str(example), "--mode", "rl", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"-m ember.midtrain.rl.run {example.resolve()}" in result.output
    result = CliRunner().invoke(app, ["launch", str(example), "--mode", "rl", "--dry-run", "--procs-per-node", "2"])
    assert result.exit_code == 0 and "--nproc-per-node 2" in result.output, result.output
    data["rl"]["alpha"] = 0.5
    data["parallel"] = {"expert": 2}
    config_path = tmp_path / "ep.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = CliRunner().invoke(app, ["launch", str(config_path), "--mode", "rl", "--dry-run", "--procs-per-node", "3"])
    assert result.exit_code == 2 and "world size 3 is not a multiple of parallel.expert 2" in result.output
    data["parallel"] = {"tensor": 2}
    with pytest.raises(MidtrainConfigError, match="tensor and pipeline must be 1"):
        parse_rl_config(data, tmp_path)


def test_demo_steps_report_the_mismatch_per_step(batches, tmp_path):
    from rich.console import Console

    from ember.demo.rl_stage import run_demo_steps

    _root, prefix, _init, _ids = batches
    rows = dict(run_demo_steps(Console(quiet=True), prefix, tmp_path, steps=2))
    assert rows["rl router replay"].startswith("on:")
    assert "2 MoE layers x 8 experts (top-2)" in rows["rl model"]
    assert rows["rl routing vs sampler (tokens differing)"] == "0.000 -> 0.000"
    deltas = [float(x) for x in rows["rl mean |delta logp| (trainer vs sampler)"].split(" -> ")]
    assert len(deltas) == 2 and all(d > 0 for d in deltas)
    assert rows["rl steps"].startswith("2 batches")
