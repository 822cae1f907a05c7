"""`midtrain launch` on the real local Slurm, on shards `ember corpus build` made from raw code + web
input: train, get preempted, requeue, resume, finish.

The preemption is the real mechanism: `scancel --signal=USR1 --batch` delivers what
`--signal=B:USR1@<s>` delivers before a time limit; the batch script forwards it, the trainer
checkpoints, the script requeues the job and the second run resumes from the checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ember.midtrain.config import load_config

from .configs import corpus_run

pytestmark = pytest.mark.integration

MIDTRAIN = [sys.executable, "-m", "ember.midtrain.cli"]
STEPS = 16


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _wait(what: str, predicate, timeout: float, job_id: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; job: {_job(job_id)}", pytrace=False)


def test_launch_preempt_requeue_resume_without_repeating_or_skipping(tmp_path, slurm, hf_tokenizer_path):
    config_path = corpus_run(tmp_path, hf_tokenizer_path, steps=STEPS, save_interval=4)
    config = load_config(config_path)
    submitted = subprocess.run(
        [*MIDTRAIN, "launch", str(config_path), "--time", "00:20:00"], capture_output=True, text=True, timeout=120
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    first_log = config.run_dir / "logs" / f"train-{job_id}-0.log"
    followed_path, follow_err_path = tmp_path / "follow.out", tmp_path / "follow.err"
    with open(followed_path, "w") as out, open(follow_err_path, "w") as err:
        follower = subprocess.Popen([*MIDTRAIN, "logs", job_id, "--follow"], stdout=out, stderr=err)
    try:
        _wait("step 2 of the first run", lambda: first_log.exists() and "] step 2/" in first_log.read_text(), 400, job_id)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        _release_requeued(job_id)
        done = _wait("completion", lambda: (f := _job(job_id))["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} and f, 400, job_id)
    finally:
        if _job(job_id)["JobState"] not in {"COMPLETED", "FAILED", "CANCELLED"}:
            subprocess.run(["scancel", job_id], timeout=30)
        if follower.poll() is None and _job(job_id)["JobState"] != "COMPLETED":
            follower.kill()
    slurm_log = (config.run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", slurm_log

    first = first_log.read_text()
    assert "received SIGUSR1" in first and "stopped at step" in first
    assert "requeueing job" in slurm_log and f"job {job_id} restart 1" in slurm_log
    second = (config.run_dir / "logs" / f"train-{job_id}-1.log").read_text()
    assert "resumed from" in second and f"finished at step {STEPS}" in second

    records = [json.loads(line) for line in config.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    restarts = [r["restart"] for r in records]
    assert restarts == sorted(restarts) and set(restarts) == {0, 1}
    ids = [i for r in records for i in r["sample_ids"]]
    assert ids == list(range(STEPS * 8)), "a sample was repeated or skipped across the restart"
    rows = [tuple(row) for r in records for row in r["rows"]]
    assert len(set(rows)) == len(rows), "a shard row was trained twice within its epoch"
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert (config.checkpoint_dir / "latest").read_text() == f"step_{STEPS:08d}"
    assert config.complete_marker.exists()
    events = EventAccumulator(str(config.run_dir))  # both runs' event files: one loss per step
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [r["step"] for r in records]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)

    follower.wait(timeout=60)  # it ends by itself once the job has
    followed, follow_err = followed_path.read_text(), follow_err_path.read_text()
    assert follower.returncode == 0 and f"job {job_id} ended: COMPLETED" in follow_err, follow_err
    assert "received SIGUSR1" in followed and followed.index("requeueing job") < followed.index(f"finished at step {STEPS}")
    assert f"==> {config.run_dir / 'logs'}/train-{job_id}-1.log <==" in followed

    status = subprocess.run([*MIDTRAIN, "status", job_id], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "COMPLETED" in status.stdout and re.search(r"Restarts: 1", status.stdout)
    logs = subprocess.run([*MIDTRAIN, "logs", job_id], capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0
    assert logs.stdout.index(f"train-{job_id}-0.log") < logs.stdout.index(f"train-{job_id}-1.log")


def _sbatch(tmp_path, name: str, body: str) -> tuple[str, Path]:
    """Submits a bash job named `name` whose Slurm log sits where a midtrain job's does; returns (job id, logs/)."""
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    script = tmp_path / f"{name}.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --output={logs}/slurm-%j.out\n#SBATCH --time=00:05:00\n{body}\n")
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split(";")[0], logs


def test_logs_follow_prints_a_growing_job_and_a_new_trainer_log_until_it_ends(tmp_path, slurm):
    job_id, logs = _sbatch(tmp_path, "midtrain-follow", f"""
for i in 1 2 3; do echo "slurm line $i"; sleep 1; done
for i in 1 2 3; do echo "trainer line $i" >> "{tmp_path}/logs/train-$SLURM_JOB_ID-0.log"; sleep 1; done
echo "slurm done"
""")
    follow = subprocess.run([*MIDTRAIN, "logs", job_id, "--follow"], capture_output=True, text=True, timeout=180)
    assert follow.returncode == 0, follow.stderr
    assert f"job {job_id} ended: COMPLETED" in follow.stderr
    out = follow.stdout
    assert f"==> {logs}/slurm-{job_id}.out <==" in out and f"==> {logs}/train-{job_id}-0.log <==" in out
    lines = [l for l in out.splitlines() if "line" in l or "done" in l]
    assert lines == [f"slurm line {i}" for i in (1, 2, 3)] + [f"trainer line {i}" for i in (1, 2, 3)] + ["slurm done"]


def _interruptible() -> None:
    """SIGINT at its default in the follower, as in a terminal: a suite started in the background (a non-interactive
    shell's `cmd &`) passes SIGINT down ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_logs_follow_stops_on_ctrl_c_and_leaves_the_job_running(tmp_path, slurm):
    job_id, logs = _sbatch(tmp_path, "midtrain-ctrl-c", 'echo started; sleep 120')
    slurm_log = logs / f"slurm-{job_id}.out"
    try:
        follower = subprocess.Popen([*MIDTRAIN, "logs", job_id, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=_interruptible)
        _wait("the job's first line", lambda: slurm_log.exists() and "started" in slurm_log.read_text(), 120, job_id)
        time.sleep(2)
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=30)
        assert follower.returncode == 130, err
        assert "started" in out and f"stopped following job {job_id} (the job keeps running)" in err and "Traceback" not in err
        assert _job(job_id)["JobState"] == "RUNNING"
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


def test_status_of_every_midtrain_job_takes_one_scontrol_call(tmp_path, slurm):
    """`midtrain status` with no id lists every midtrain job; with ids, all of them from the same single call."""
    calls = tmp_path / "calls"
    shim = tmp_path / "bin"
    shim.mkdir()
    real = shutil.which("scontrol")
    (shim / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\nexec {real} "$@"\n')
    (shim / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    ids = [_sbatch(tmp_path, name, "sleep 120")[0] for name in ("midtrain-status-a", "midtrain-status-b")]
    try:
        (tmp_path / "logs" / f"train-{ids[0]}-0.log").write_text("[midtrain] step 1/9 loss 5\n[midtrain] step 2/9 loss 4\n")
        listed = subprocess.run([*MIDTRAIN, "status"], capture_output=True, text=True, timeout=60, env=env)
        assert listed.returncode == 0, listed.stderr
        assert all(f"JobId: {i}" in listed.stdout for i in ids) and "midtrain-status-b" in listed.stdout
        assert calls.read_text().splitlines() == ["show job -o"]
        named = subprocess.run([*MIDTRAIN, "status", *ids], capture_output=True, text=True, timeout=60, env=env)
        assert named.returncode == 0, named.stderr
        assert named.stdout.index(f"JobId: {ids[0]}") < named.stdout.index(f"JobId: {ids[1]}")
        assert "last step: [midtrain] step 2/9 loss 4" in named.stdout
        assert calls.read_text().splitlines() == ["show job -o"] * 2
    finally:
        subprocess.run(["scancel", *ids], timeout=30)


def _release_requeued(job_id: str) -> None:
    """Waits for the requeue; a requeued job is held back ~2 min, so release it (not within the second
    its previous credential was revoked: slurmd compares them at one-second resolution)."""
    requeued = _wait(
        "the requeue", lambda: (f := _job(job_id))["Restarts"] == "1" and f["JobState"] in {"PENDING", "RUNNING"} and f,
        180, job_id,
    )
    if requeued["JobState"] == "PENDING":
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)


def test_launch_rl_on_two_ranks_preempt_requeue_resume_trains_every_batch_once(tmp_path, slurm, kafka, sampled_policy):
    """`midtrain launch --mode rl` with 2 ranks: preempted (USR1) after step 2, requeued, resumed at step 3.
    Batches are fed by hand, so the first run cannot train past step 2 before the preemption."""
    import uuid

    import yaml

    from ember.midtrain.config import load_rl_config
    from ember.schemas import decode_train_batch

    from .rl_support import BatchFeed, rl_config

    values = [p.read_bytes() for p in sampled_policy.batches(4)]
    ids = [decode_train_batch(v).batch_id for v in values]
    prefix = f"test-rl-slurm-{uuid.uuid4().hex[:8]}"
    feed = BatchFeed(prefix)
    config_path = rl_config(tmp_path / "rl.yaml", tmp_path / "run", prefix, steps=len(values), save_interval=0, correction="tis")
    data = yaml.safe_load(config_path.read_text())
    data["init_checkpoint"] = str(sampled_policy.init_checkpoint)
    data["rollouts"]["idle_timeout_s"] = 600
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    config = load_rl_config(config_path)
    feed.send(values[:2])
    submitted = subprocess.run(
        [*MIDTRAIN, "launch", str(config_path), "--mode", "rl", "--procs-per-node", "2", "--threads", "1", "--time", "00:20:00"],
        capture_output=True, text=True, timeout=120,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    first_log, second_log = (config.run_dir / "logs" / f"train-{job_id}-{r}.log" for r in (0, 1))
    try:
        _wait("step 2 of the first run", lambda: first_log.exists() and "] step 2/" in first_log.read_text(), 400, job_id)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        _release_requeued(job_id)
        _wait("the resumed run", lambda: second_log.exists() and "resumed from" in second_log.read_text(), 400, job_id)
        feed.send(values[2:])
        done = _wait("completion", lambda: (f := _job(job_id))["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} and f, 400, job_id)
    finally:
        feed.close()
        if _job(job_id)["JobState"] not in {"COMPLETED", "FAILED", "CANCELLED"}:
            subprocess.run(["scancel", job_id], timeout=30)
    slurm_log = (config.run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", slurm_log
    first, second = first_log.read_text(), second_log.read_text()
    assert "2 rank(s), dp 2" in first and "received SIGUSR1" in first and "stopped at step 2" in first
    assert "requeueing job" in slurm_log and f"finished at step {len(values)}" in second

    records = [json.loads(line) for line in config.metrics_path.read_text().splitlines()]
    assert [r.get("event") for r in records].count("resumed") == 1
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, len(values) + 1))
    assert [r["batch_id"] for r in steps] == ids, "every batch trained once across the requeue, none skipped"
    assert all(r["ranks"] == 2 and r["rank_sequences"] == [2, 2] and r["routing_disagreement"] == 0.0 for r in steps)
    assert config.complete_marker.read_text() == f"{len(values)}\n"
