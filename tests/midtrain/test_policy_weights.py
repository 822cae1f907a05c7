"""Policy versions that carry weights: the announcement record, the cadence, the Hugging Face export, a
separate sampler process scoring the announced weights as the trainer does, crash safety of announce-after-
export, and the ETL's staleness on those announcements, against the real broker.

Megatron-core keeps global parallel state, so every trainer runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ember.midtrain.config import ModelConfig, MoEConfig
from ember.midtrain.export_format import CONFIG_FILE, MANIFEST_FILE, PolicyFetchError, read_export, sha256
from ember.midtrain.export_hf import ExportError, hf_tensors, unsupported
from ember.midtrain.hf_policy import load_policy, local_path
from ember.rollouts.records import PolicyVersion
from ember.rollouts.simulate import distinct_top_k, synthetic_rollout
from ember.rollouts.topics import Topics
from ember.schemas import Reward, TrainBatch, encode_train_batch

from .rl_support import rl_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


# ---- the record and the config ---------------------------------------------------------------


def test_policy_version_record_carries_weights_and_old_records_still_decode():
    new = PolicyVersion.now(3, "file:///runs/a/versions/version_3", "ab" * 32)
    assert PolicyVersion.decode(new.encode()) == new and new.carries_weights
    old = PolicyVersion.decode(b'{"policy_version": 4, "published_at_us": 9}')  # what simulate and publish-policy write
    assert old == PolicyVersion(4, 9) and not old.carries_weights
    assert json.loads(PolicyVersion(4, 9).encode()) == {"policy_version": 4, "published_at_us": 9}, "old readers see v1"
    for raw, why in [
        (b'{"policy_version": 1, "weights_uri": "file:///x"}', "together or neither"),
        (b'{"policy_version": 1, "weights_uri": "file:///x", "weights_sha256": "ABC"}', "64 lowercase hex"),
        (b'{"policy_version": 1, "weights_uri": "/no/scheme", "weights_sha256": "' + b"0" * 64 + b'"}', "a URI"),
        (b'{"policy_version": 1, "weights_uri": 7, "weights_sha256": "' + b"0" * 64 + b'"}', "a URI"),
    ]:
        with pytest.raises(ValueError, match=why):
            PolicyVersion.decode(raw)


def test_publish_interval_must_land_on_checkpoints(tmp_path):
    from ember.configs import MidtrainConfigError
    from ember.midtrain.config import parse_rl_config

    def settings(**rl):
        return parse_rl_config(yaml.safe_load(rl_config(tmp_path / "c.yaml", tmp_path, "p", **rl).read_text()), tmp_path).rl

    with pytest.raises(MidtrainConfigError, match=r"rl\.publish_interval: 3 announces versions that are not checkpointed"):
        settings(save_interval=2, publish_interval=3)
    with pytest.raises(MidtrainConfigError, match="only at the end: save_interval 0"):
        settings(save_interval=0, publish_interval=4)
    every_other = settings(save_interval=2, publish_interval=4)
    assert [s for s in range(1, 9) if every_other.announces(s)] == [4, 8]
    assert [s for s in range(1, 7) if settings(save_interval=3).announces(s)] == [3, 6], "null: every checkpoint"
    assert not any(settings(save_interval=0).announces(s) for s in range(1, 5)), "only the start and the end"


# ---- the export mapping ----------------------------------------------------------------------


def test_export_splits_grouped_qkv_and_swiglu_into_mixtral_names():
    """4 heads in 2 query groups, head_dim 2: megatron's rows are [q0 q1 k v] per group."""
    model = ModelConfig(tokenizer="t", vocab_size=8, seq_len=8, num_layers=1, hidden_size=8, num_attention_heads=4, num_query_groups=2)
    moe = MoEConfig(num_experts=2, router_topk=2, ffn_hidden_size=3)
    rows = torch.arange(16, dtype=torch.float32)[:, None].expand(16, 8)  # row i holds the value i
    fc1 = torch.arange(2 * 6, dtype=torch.float32).view(1, 2, 6, 1).expand(1, 2, 6, 8)
    tensors = {
        "embedding.word_embeddings.weight": torch.zeros(8, 8),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.ones(1, 8),
        "decoder.layers.self_attention.linear_qkv.weight": rows[None],
        "decoder.layers.self_attention.linear_proj.weight": torch.zeros(1, 8, 8),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.ones(1, 8),
        "decoder.layers.mlp.router.weight": torch.zeros(1, 2, 8),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": fc1,
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": torch.zeros(1, 2, 8, 3),
        "decoder.final_layernorm.weight": torch.ones(8),
        "output_layer.weight": torch.zeros(8, 8),
    }
    out = hf_tensors(tensors, model, moe)
    attn = "model.layers.0.self_attn."
    assert out[attn + "q_proj.weight"][:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert out[attn + "k_proj.weight"][:, 0].tolist() == [4, 5, 12, 13]
    assert out[attn + "v_proj.weight"][:, 0].tolist() == [6, 7, 14, 15]
    expert1 = "model.layers.0.block_sparse_moe.experts.1."
    assert out[expert1 + "w1.weight"][:, 0].tolist() == [6, 7, 8], "gate: the first half of fc1"
    assert out[expert1 + "w3.weight"][:, 0].tolist() == [9, 10, 11], "up: the second half"
    with pytest.raises(ExportError, match="2 experts"):
        hf_tensors(tensors, model, moe.model_copy(update={"num_experts": 4}))
    gelu = model.model_copy(update={"swiglu": False, "position_embedding": "learned_absolute"})
    assert len(unsupported(gelu, moe)) == 2


# ---- a real run against the broker ---------------------------------------------------------------


def _batches(count: int) -> list[TrainBatch]:
    """Small valid batches for the toy policy: two 12-token sequences each, routed top-2 of 8 experts per layer."""
    rng = np.random.default_rng(5)
    batches = []
    for step in range(count):
        tokens = rng.integers(0, 16, size=24).astype(np.uint32)
        mask = np.tile(np.r_[np.zeros(4), np.ones(8)], 2).astype(np.uint8)
        batches.append(TrainBatch(
            batch_id=f"pw-{step}", step=step, tokens=tokens, loss_mask=mask,
            advantages=np.where(mask == 1, np.repeat([0.5, -0.5], 12), 0).astype(np.float32),
            sampler_logprobs=np.where(mask == 1, -2.5, 0).astype(np.float32), cu_seqlens=np.array([0, 12, 24], np.int32),
            policy_versions=np.zeros(2, np.int64), rollout_ids=[f"pw-{step}-a", f"pw-{step}-b"],
            routed_experts=distinct_top_k(rng, (24, 2), 2, 8).astype(np.uint8),
        ).validate())
    return batches


def _trainer(config: Path, fault: str | None, log: Path) -> tuple[int, str]:
    """`midtrain rl` in its own session; after it exits (or kills itself at `fault`) the session is ended,
    so the checkpoint writer's helper process a SIGKILL orphans does not outlive the test."""
    env = {k: v for k, v in os.environ.items() if k != "EMBER_FAULT"}
    if fault:
        env["EMBER_FAULT"] = fault
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ember.midtrain.cli", "rl", str(config)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=400)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return code, log.read_text()


def _announced(prefix: str) -> list[PolicyVersion]:
    from tests.rollouts.etl_support import read_topic

    return [PolicyVersion.decode(r.value) for r in read_topic(Topics(prefix).policy_versions)]


@pytest.fixture(scope="module")
def run(kafka, tmp_path_factory):
    """`midtrain rl` killed -9 right after a checkpoint (before its export), restarted and killed right after
    an export (before its announcement), then restarted to the end; the announcements after each run."""
    from kafka import KafkaProducer

    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.transport import producer_config

    root = tmp_path_factory.mktemp("policy-weights")
    prefix = f"test-pw-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    ensure_topics(kafka, list(topics.specs(1).values()))
    producer = KafkaProducer(**producer_config(None, bootstrap_servers=kafka))
    for batch in _batches(STEPS):
        producer.send(topics.train_batches, key=batch.batch_id.encode(), value=encode_train_batch(batch))
    producer.flush()
    producer.close()
    config = rl_config(root / "rl.yaml", root / "run", prefix, steps=STEPS, save_interval=1, publish_interval=2, correction="tis")
    data = yaml.safe_load(config.read_text())
    data["model"]["num_query_groups"] = 2  # grouped-query attention, so the export's q/k/v split is exercised
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    seen, on_disk = [], []
    # run 1: announces version 0, trains steps 1 and 2, checkpoints step 2 and dies before exporting it
    # run 2: resumes at 2, exports and announces it, trains 3 and 4, exports 4 and dies before announcing it
    # run 3: resumes at 4, announces the export run 2 left, trains 5 and 6 and announces 6
    for i, fault in enumerate(("rl.before_export:2", "rl.before_announce:2", None)):
        code, output = _trainer(config, fault, root / f"trainer-{i}.log")
        assert code == (-signal.SIGKILL if fault else 0), output[-4000:]
        versions = root / "run" / "versions"
        on_disk.append(sorted(p.name for p in versions.iterdir()) if versions.exists() else [])
        seen.append(_announced(prefix))
    return root, prefix, config, seen, on_disk


@pytest.mark.integration
def test_a_version_is_announced_only_after_its_export_is_durable_even_across_kill_9(run):
    root, _, _, seen, on_disk = run
    versions = root / "run" / "versions"
    after_first, after_second, final = ([v.policy_version for v in announced] for announced in seen)
    assert after_first == [0], "killed after checkpoint 2, before its export: nothing announced for it"
    assert on_disk[0] == ["version_0"], "and nothing exported for it, not even a temporary"
    assert after_second == [0, 2], "killed after exporting 4, before announcing it"
    assert on_disk[1] == ["version_0", "version_2", "version_4"], "version 4 complete on disk, not announced"
    assert final == [0, 2, 4, 6], "the restart announced the export it found, once, in order"
    for record in seen[-1]:
        path = versions / f"version_{record.policy_version}"
        assert record.weights_uri == path.resolve().as_uri()
        assert sha256((path / MANIFEST_FILE).read_bytes()) == record.weights_sha256, "the announcement pins the manifest"
        manifest = read_export(path, record.weights_sha256).manifest
        assert manifest.source_checkpoint.endswith(f"step_{record.policy_version:08d}"), "a checkpointed version"
        assert (manifest.policy_version, manifest.step) == (record.policy_version, record.policy_version)
    assert json.loads((versions / "version_6" / CONFIG_FILE).read_text())["num_key_value_heads"] == 2


@pytest.mark.integration
def test_a_separate_sampler_process_scores_the_announced_version_as_the_trainer_does(run, tmp_path):
    root, _, config, seen, _ = run
    last = seen[-1][-1]
    rng = np.random.default_rng(9)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"sequences": [rng.integers(0, 16, size=n).tolist() for n in (10, 17, 24)]}))
    sampler = subprocess.Popen(  # beside the trainer's scoring below: two separate processes either way
        [sys.executable, "-m", "ember.midtrain.hf_policy", last.weights_uri, last.weights_sha256, str(probe), str(tmp_path / "sampler.json")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        trainer = subprocess.run(
            [sys.executable, "-m", "tests.midtrain.rl_support", "score", str(config), str(probe), str(tmp_path / "trainer.json")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )
        _, sampler_err = sampler.communicate(timeout=120)
    finally:
        if sampler.poll() is None:
            sampler.kill()
    assert sampler.returncode == 0, sampler_err[-3000:]
    assert trainer.returncode == 0, trainer.stdout[-3000:] + trainer.stderr[-3000:]
    trained = json.loads((tmp_path / "trainer.json").read_text())
    assert trained["step"] == last.policy_version == STEPS
    sampled = json.loads((tmp_path / "sampler.json").read_text())["logprobs"]
    for mine, theirs in zip(sampled, trained["logprobs"]):
        np.testing.assert_allclose(mine, theirs, atol=2e-5)
    first = seen[-1][0]
    start = load_policy(first.weights_uri, first.weights_sha256)
    sequences = json.loads(probe.read_text())["sequences"]
    moved = max(abs(a - b) for s, t in zip(sequences, trained["logprobs"]) for a, b in zip(start.token_logprobs(s), t))
    assert moved > 1e-3, "six steps changed the policy: the comparison can tell versions apart"


@pytest.mark.integration
def test_the_sampler_refuses_weights_that_do_not_match_the_announcement(run):
    last = run[3][-1][-1]  # the announcements after the last run, the newest
    with pytest.raises(PolicyFetchError, match="not the announced export"):
        load_policy(last.weights_uri, "0" * 64)
    with pytest.raises(PolicyFetchError, match="only file://"):
        load_policy("s3://bucket/v6", last.weights_sha256)


@pytest.mark.integration
def test_the_etl_measures_staleness_against_announced_versions_and_old_records(kafka, run):
    """Announcements with weights and an old-format one (`ember rollouts publish-policy`, the integer alone)
    both move the ETL's latest version; a rollout group of version 6 is batched, one of version 2 is stale."""
    from typer.testing import CliRunner

    from ember.rollouts.cli import rollouts_app
    from ember.rollouts.config import parse_config
    from ember.rollouts.etl import EtlService, PolicyWatcher
    from ember.rollouts.transport import RewardWriter, RolloutWriter
    from tests.rollouts.etl_support import books, etl_settings

    prefix = run[1]
    topics = Topics(prefix)
    published = CliRunner().invoke(rollouts_app, ["publish-policy", "7", "--prefix", prefix])
    assert published.exit_code == 0, published.output
    watcher = PolicyWatcher(kafka, topics.policy_versions)
    try:
        watcher.catch_up()
        assert (watcher.latest, watcher.invalid) == (7, 0)
    finally:
        watcher.close()
    rng = np.random.default_rng(2)
    now = time.time_ns() // 1000
    with RolloutWriter(prefix) as rollouts, RewardWriter(prefix) as rewards:
        for version in (6, 2):
            for i in range(4):
                rollout = synthetic_rollout(
                    rng, group_id=f"v{version}", prompt_id=f"v{version}", num_tokens=32, prompt_tokens=8, turns=2,
                    layers=None, policy_version=version, rollout_id=f"v{version}-{i}", created_at_us=now,
                )
                rollouts.write(rollout)
                rewards.write(Reward(rollout.rollout_id, rollout.group_id, "unit-tests", float(i % 2), now))
    settings = etl_settings(prefix, partitions=1, filters={"max_policy_lag": 2}, groups={"size": 4, "quorum": 4, "timeout_s": 10})
    EtlService(parse_config(settings), "pw-test").run(until_idle_s=2.0)
    found = books(topics)
    assert sorted(rid for rid in found.batched if rid.startswith("v6-")) == [f"v6-{i}" for i in range(4)]
    stale = [o for o in found.dropped if o.group_id == "v2"]
    assert [o.reason for o in stale] == ["stale"] * 4 and stale[0].detail["lag_versions"] == 5


@pytest.mark.integration
def test_export_hf_command_writes_the_bytes_the_trainer_announced(run, tmp_path):
    from typer.testing import CliRunner

    from ember.midtrain.cli import app

    root, _, _, seen, _ = run
    checkpoint = root / "run" / "checkpoints" / f"step_{STEPS:08d}"
    result = CliRunner().invoke(app, ["export-hf", str(checkpoint), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    by_hand = read_export(tmp_path / "hf")
    assert f"sha256: {by_hand.sha256} (export.json" in result.output
    announced = read_export(local_path(seen[-1][-1].weights_uri), seen[-1][-1].weights_sha256)
    assert by_hand.manifest.files == announced.manifest.files, "the same checkpoint exports to the same bytes"
    assert by_hand.manifest.policy_version is None, "only the trainer knows the version it announces"
    config_json = json.loads((tmp_path / "hf" / CONFIG_FILE).read_text())
    assert config_json["architectures"] == ["MixtralForCausalLM"]
    assert {k: config_json[k] for k in ("vocab_size", "num_local_experts", "num_experts_per_tok", "rope_theta", "max_position_embeddings")} == {
        "vocab_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 10000.0, "max_position_embeddings": 64,
    }
    assert config_json["ember"] == {"tokenizer": "toy", "tokenizer_vocab_size": 16}
    again = CliRunner().invoke(app, ["export-hf", str(checkpoint), "--out", str(tmp_path / "hf")])
    assert again.exit_code == 2 and "exists" in again.output
    missing = CliRunner().invoke(app, ["export-hf", str(tmp_path), "--out", str(tmp_path / "hf2")])
    assert missing.exit_code == 2 and "not a megatron dist checkpoint" in missing.output


@pytest.mark.integration
def test_a_run_publishing_deltas_to_s3_announces_versions_the_sampler_rebuilds_with_the_trainers_digest(kafka, s3_bucket, tmp_path):
    """`midtrain rl` with rl.publish_uri on the local S3 server and full_every_k 2: versions 0 and 2 full, 1 and 3
    deltas, each announced at its S3 URI; a sampler joining at version 3 walks from version 2 and its rebuilt weights
    are the bytes a full export of the same checkpoint holds. A bucket that does not exist stops the run first, exit 2."""
    from kafka import KafkaProducer

    from ember import storage
    from ember.inference.policy import load_policy as sampler_load
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.export_format import WEIGHTS_FILE
    from ember.midtrain.export_hf import export_files
    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.transport import producer_config

    prefix = f"test-pw-s3-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    ensure_topics(kafka, list(topics.specs(1).values()))
    producer = KafkaProducer(**producer_config(None, bootstrap_servers=kafka))
    for batch in _batches(3):
        producer.send(topics.train_batches, key=batch.batch_id.encode(), value=encode_train_batch(batch))
    producer.flush()
    producer.close()
    missing = rl_config(tmp_path / "missing.yaml", tmp_path / "missing", prefix, steps=3, publish_uri=f"{s3_bucket}-none/run")
    code, output = _trainer(missing, None, tmp_path / "missing.log")
    assert code == 2 and f"bucket '{s3_bucket.removeprefix('s3://')}-none' does not exist" in output, output[-2000:]
    config = rl_config(tmp_path / "rl.yaml", tmp_path / "run", prefix, steps=3, save_interval=1, correction="tis",
                       publish_uri=f"{s3_bucket}/run", full_every_k=2, keep_versions=2)
    code, output = _trainer(config, None, tmp_path / "trainer.log")
    assert code == 0, output[-4000:]
    announced = _announced(prefix)
    assert [(v.policy_version, v.weights_uri) for v in announced] == [(i, f"{s3_bucket}/run/version_{i}") for i in range(4)]
    formats = [json.loads(storage.read_bytes(f"{v.weights_uri}/{MANIFEST_FILE}"))["format"] for v in announced[2:]]
    assert formats == [2, 3], "versions 0 and 1 left the store (keep_versions 2)"
    last = announced[-1]
    policy = sampler_load(last.weights_uri, last.weights_sha256, last.policy_version)
    assert policy.sha256 == last.weights_sha256
    source = Path(json.loads(storage.read_bytes(f"{last.weights_uri}/{MANIFEST_FILE}"))["source_checkpoint"])
    rl = load_rl_config(config)
    assert policy.files.files[WEIGHTS_FILE] == export_files(source, rl.model, rl.moe)[WEIGHTS_FILE]
