"""`ember rollouts sample`: rollouts drawn by transformers from a published export, on the real broker.

Exports are the tiny RL example's shape written by the real exporter (tests/inference/support.py); every check
recomputes with transformers' own forward pass (`MixtralForCausalLM(input_ids)`, one unpadded sequence, no
cache), not with the sampler's batched, cached loop.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from kafka import KafkaConsumer
from typer.testing import CliRunner

from ember.cli import app
from ember.inference import worker
from ember.inference.config import load_config
from ember.inference.generate import Sampling, generate, sampling_logprobs
from ember.inference.policy import LoadedPolicy, load_policy
from ember.midtrain.export_format import PolicyFetchError
from ember.inference.tasks import read_tasks
from ember.midtrain.rl.run import PolicyVersionPublisher
from ember.rollouts.admin import ensure_topics
from ember.rollouts.records import PolicyVersion
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics
from ember.rollouts.transport import RolloutWriter, consumer_config
from ember.schemas import Rollout, decode
from ember.tokenize.tokenizers import load_tokenizer
from tests.inference.support import export_version
from tests.tokenize.support import train_tokenizer

G = 3
TASKS = [
    {"prompt_id": "add", "prompt": "def add(a, b):\n"},
    {"id": "HumanEval/0", "prompt": "import json\n\ndef load(path):\n", "tests": "ignored"},
    {"prompt_id": "sub", "prompt": "def sub(a, b):\n    return"},
    {"prompt_id": "long", "prompt": "x = [" + ", ".join(map(str, range(200))) + "]\n"},  # longer than 64 - max_new_tokens
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """Two policy versions (different weights), the 512-id byte-level BPE the export names, and a task set
    with one malformed line and one prompt too long for the policy."""
    root = tmp_path_factory.mktemp("sampler")
    tasks = root / "tasks.jsonl"
    lines = [json.dumps(TASKS[0]), json.dumps(TASKS[1]), "{not json", json.dumps(TASKS[2]), json.dumps(TASKS[3])]
    tasks.write_text("\n".join(lines) + "\n")
    return {
        "root": root, "v1": export_version(root, 1, seed=1), "v2": export_version(root, 2, seed=2),
        "tokenizer": train_tokenizer(root / "tokenizer.json", vocab_size=512), "tasks": tasks,
    }


def _config(workspace: dict, prefix: str, path: Path, **generation) -> Path:
    data = {
        "kafka": {"topic_prefix": prefix},
        "tasks": str(workspace["tasks"]),
        "tokenizer": {"name": "byte-bpe", "path": str(workspace["tokenizer"]), "eos_token": "<|endoftext|>"},
        "policy": {"follow": True, "wait_s": 30},
        "generation": {"group_size": G, "batch_size": 2 * G, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12,
                       "seed": 3, **generation},
        "run_id": path.stem,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def _announce(kafka: str, prefix: str, version: int, exported) -> None:
    """As the trainer announces an export (`midtrain rl`'s publisher)."""
    publisher = PolicyVersionPublisher(prefix, kafka, KafkaSecurity())
    try:
        publisher.publish(PolicyVersion.now(version, exported.uri, exported.sha256))
    finally:
        publisher.close()


def _rollouts(kafka: str, prefix: str, at_least: int, timeout_s: float = 60) -> list[Rollout]:
    consumer = KafkaConsumer(Topics(prefix).rollouts, **consumer_config(None, bootstrap_servers=kafka, group_id=None))
    found, deadline = [], time.monotonic() + timeout_s
    try:
        while len(found) < at_least and time.monotonic() < deadline:
            for messages in consumer.poll(timeout_ms=500).values():
                found += [decode(m.value) for m in messages]
    finally:
        consumer.close()
    return found


def _recomputed(policy: LoadedPolicy, rollout: Rollout, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """Sampling-distribution log-probs of the completion tokens and router top-k of every token, from one plain
    forward pass of transformers over the rollout's tokens."""
    ids = torch.from_numpy(rollout.tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0]
        routers = policy.model.model(input_ids=ids, output_router_logits=True).router_logits
    logp = sampling_logprobs(logits, sampling, policy.config.ember.tokenizer_vocab_size)
    token_logp = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()[rollout.prompt_tokens - 1 :]
    experts = torch.stack([r.topk(policy.config.num_experts_per_tok, -1).indices for r in routers], dim=1).numpy()
    return token_logp, experts


def test_sample_publishes_rollouts_whose_logprobs_and_experts_transformers_reproduces(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=2).values()))
    v1 = workspace["v1"]
    _announce(kafka, topic_prefix, 1, v1)
    result = CliRunner().invoke(app, ["rollouts", "sample", str(_config(workspace, topic_prefix, tmp_path / "once.yaml"))])
    assert result.exit_code == 0, result.output
    assert "published 9 rollouts (3 groups" in result.output and "2 tasks rejected, 0 versions refused" in result.output
    assert f"{workspace['tasks']}:3: " in result.output and "task long: " in result.output

    rollouts = _rollouts(kafka, topic_prefix, 9)
    assert len(rollouts) == 9
    assert sorted({r.prompt_id for r in rollouts}) == ["HumanEval/0", "add", "sub"]
    policy = load_policy(v1.uri, v1.sha256, 1)
    sampling = Sampling(0.8, 0.9, 12, eos_id=None, pad_id=0)
    tokenizer = load_tokenizer(load_config(tmp_path / "once.yaml").tokenizer)
    for rollout in rollouts:
        n, p = rollout.num_tokens, rollout.prompt_tokens
        prompt = next(t for t in TASKS if t.get("prompt_id", t.get("id")) == rollout.prompt_id)["prompt"]
        assert rollout.tokens[:p].tolist() == tokenizer.encode_ordinary([prompt])[0]
        assert 0 < n - p <= 12 and rollout.loss_mask.tolist() == [0] * p + [1] * (n - p)
        assert (rollout.policy_version, rollout.policy_version_end) == (1, 1)
        assert rollout.finish_reason == ("stop" if rollout.tokens[-1] == tokenizer.eos_id else "length")
        assert rollout.routed_experts.dtype == np.uint8 and rollout.routed_experts.shape == (n, 2, 2)
        logp, experts = _recomputed(policy, rollout, sampling)
        assert np.all(np.isfinite(rollout.sampler_logprobs)) and np.all(rollout.sampler_logprobs[:p] == 0)
        np.testing.assert_allclose(rollout.sampler_logprobs[p:], logp, atol=1e-4)
        np.testing.assert_array_equal(rollout.routed_experts, experts)


def test_an_export_with_one_byte_of_config_changed_is_refused_naming_the_file(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=1).values()))
    tampered = Path(shutil.copytree(workspace["v1"].path, tmp_path / "version_1"))
    config = bytearray((tampered / "config.json").read_bytes())
    config[config.index(b'"rms_norm_eps": 1e-05') + len('"rms_norm_eps": 1e-0')] = ord("4")
    (tampered / "config.json").write_bytes(bytes(config))
    _announce(kafka, topic_prefix, 1, type(workspace["v1"])(tampered, workspace["v1"].sha256))
    result = CliRunner().invoke(app, ["rollouts", "sample", str(_config(workspace, topic_prefix, tmp_path / "tampered.yaml"))])
    assert result.exit_code == 2, result.output
    assert f"{tampered / 'config.json'} hashes to " in result.output and "the file changed" in result.output
    assert _rollouts(kafka, topic_prefix, 1, timeout_s=2) == []


def test_a_version_announced_mid_run_is_verified_and_swapped_in_between_batches(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=2).values()))
    v1, v2 = workspace["v1"], workspace["v2"]
    _announce(kafka, topic_prefix, 1, v1)
    config = load_config(_config(workspace, topic_prefix, tmp_path / "swap.yaml", max_new_tokens=4))
    config = config.model_copy(update={"epochs": 10_000})
    tokenizer = load_tokenizer(config.tokenizer)
    stats, stop = worker.SampleStats(), threading.Event()
    follower = worker.PolicyFollower(config)
    sampler = worker.Sampler(config, follower, stats)
    prompts = worker.prompt_ids(config, tokenizer, read_tasks(config.tasks).tasks, sampler.policy.config, stats.rejected_tasks)
    sampling = Sampling(0.8, 0.9, 4, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    with RolloutWriter(topic_prefix, bootstrap_servers=kafka) as writer:
        thread = threading.Thread(target=worker.run, args=(config, prompts, sampling, writer, sampler, stats, stop))
        thread.start()
        try:
            assert _rollouts(kafka, topic_prefix, 1), "no rollout from version 1"
            _announce(kafka, topic_prefix, 2, v2)
            deadline = time.monotonic() + 60
            while 2 not in stats.versions and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)  # a few batches more under version 2
        finally:
            stop.set()
            thread.join(timeout=60)
        follower.close()
    assert stats.versions == [1, 2] and sampler.policy.sha256 == v2.sha256 and not stats.refused
    rollouts = _rollouts(kafka, topic_prefix, stats.rollouts)
    assert len(rollouts) == stats.rollouts and len({r.rollout_id for r in rollouts}) == len(rollouts)
    spans = [(r.policy_version, r.policy_version_end) for r in sorted(rollouts, key=lambda r: r.created_at_us)]
    assert set(spans) == {(1, 1), (2, 2)}
    first_two = spans.index((2, 2))
    assert all(span == (2, 2) for span in spans[first_two:])  # swapped once, between batches, never back
    policy = load_policy(v2.uri, v2.sha256, 2)
    later = next(r for r in rollouts if r.policy_version == 2)
    logp, experts = _recomputed(policy, later, sampling)
    np.testing.assert_allclose(later.sampler_logprobs[later.prompt_tokens :], logp, atol=1e-4)
    np.testing.assert_array_equal(later.routed_experts, experts)


def test_a_swap_within_a_batch_gives_each_rollout_the_span_of_versions_that_sampled_it(workspace):
    """`swap_every_tokens`: from step 4 on, version 2 samples; each token's log-prob is its own version's."""
    v1, v2 = workspace["v1"], workspace["v2"]
    old, new = load_policy(v1.uri, v1.sha256, 1), load_policy(v2.uri, v2.sha256, 2)
    sampling = Sampling(1.0, 1.0, 8, eos_id=None, pad_id=0)
    offered = []

    def refresh():
        offered.append(len(offered))
        return new if len(offered) == 1 else None

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [5, 6, 7]]
    done = generate(old, prompts, sampling, torch.Generator().manual_seed(0), refresh=refresh, refresh_every=4)
    assert len(offered) == 1  # asked at step 4 only (8 steps)
    for completion, prompt in zip(done, prompts):
        assert (completion.first_version, completion.last_version) == (1, 2) and completion.finish_reason == "length"
        p = len(prompt)
        ids = torch.from_numpy(completion.tokens.astype(np.int64))[None]
        for policy, steps in ((old, slice(0, 4)), (new, slice(4, 8))):
            with torch.no_grad():
                logits = policy.model(input_ids=ids).logits[0]
            logp = sampling_logprobs(logits, sampling, 512)[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()[p - 1 :]
            np.testing.assert_allclose(completion.logprobs[p:][steps], logp[steps], atol=1e-4)


def test_the_example_config_loads_and_bad_keys_are_named(tmp_path):
    from ember.inference.config import SamplerConfigError

    example = Path(__file__).resolve().parents[2] / "ember" / "inference" / "sample.example.yaml"
    config = load_config(example)
    assert config.tasks == example.parent / "../../runs/benchmarks/humaneval.jsonl" and config.generation.group_size == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text(example.read_text().replace("batch_size: 32", "batch_size: 30"))
    with pytest.raises(SamplerConfigError, match=r"batch_size \(30\) must be a multiple of group_size \(8\)"):
        load_config(bad)
    bad.write_text(example.read_text().replace("top_p: 1.0", "top_p: 1.5"))
    result = CliRunner().invoke(app, ["rollouts", "sample", str(bad)])
    assert result.exit_code == 2 and "generation.top_p" in result.output


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_an_export_on_an_object_store_is_fetched_verified_and_loaded(scheme, request, workspace, monkeypatch):
    """The local fake-gcs-server and moto S3: the announced export loads; one with a byte of config.json changed
    is refused naming the object; an export.json over the manifest limit is refused having read only the limit."""
    from ember import storage
    from ember.inference import policy as policy_module

    bucket = request.getfixturevalue(f"{scheme}_bucket")
    exported = workspace["v1"]
    for name in ("export.json", "config.json", "model.safetensors"):
        storage.upload(exported.path / name, f"{bucket}/v1/{name}")
    policy = load_policy(f"{bucket}/v1", exported.sha256, 1)
    local = load_policy(exported.uri, exported.sha256, 1)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, local.model(input_ids=ids).logits)
    config = (exported.path / "config.json").read_bytes().replace(b'"rms_norm_eps": 1e-05', b'"rms_norm_eps": 1e-04')
    storage.write_bytes(f"{bucket}/v1/config.json", config)
    with pytest.raises(PolicyFetchError, match=rf"^{bucket}/v1/config.json hashes to [0-9a-f]{{64}}, export.json records .*: the file changed$"):
        load_policy(f"{bucket}/v1", exported.sha256, 1)
    with pytest.raises(PolicyFetchError, match=rf"^{bucket}/v2/export.json: cannot be fetched"):
        load_policy(f"{bucket}/v2", exported.sha256, 1)
    monkeypatch.setattr(policy_module, "MAX_MANIFEST_BYTES", 1000)
    storage.write_bytes(f"{bucket}/v3/export.json", b"{" + b" " * 5000 + b"}")
    with pytest.raises(PolicyFetchError, match=rf"^{bucket}/v3/export.json: over 1,000 bytes, not a manifest ember wrote$"):
        load_policy(f"{bucket}/v3", exported.sha256, 1)
    assert len(storage.read_bytes(f"{bucket}/v3/export.json", limit=1000)) == 1001


def test_a_tampered_version_mid_run_is_refused_and_counted_and_the_next_good_one_taken(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=1).values()))
    v1, v2 = workspace["v1"], workspace["v2"]
    _announce(kafka, topic_prefix, 1, v1)
    config = load_config(_config(workspace, topic_prefix, tmp_path / "refuse.yaml"))
    stats = worker.SampleStats()
    follower = worker.PolicyFollower(config)
    try:
        sampler = worker.Sampler(config, follower, stats)
        tampered = Path(shutil.copytree(v2.path, tmp_path / "version_2"))
        weights = bytearray((tampered / "model.safetensors").read_bytes())
        weights[-1] ^= 1  # one bit of the last tensor
        (tampered / "model.safetensors").write_bytes(bytes(weights))
        _announce(kafka, topic_prefix, 2, type(v2)(tampered, v2.sha256))
        deadline = time.monotonic() + 30
        while not stats.refused and time.monotonic() < deadline:
            assert sampler.refresh() is None
            time.sleep(0.1)
        assert len(stats.refused) == 1 and stats.refused[0].startswith("policy version 2 refused, still sampling version 1: ")
        assert f"{tampered / 'model.safetensors'} hashes to " in stats.refused[0] and sampler.policy.version == 1
        assert sampler.refresh() is None and len(stats.refused) == 1  # refused once, not retried every batch
        _announce(kafka, topic_prefix, 3, v2)
        while sampler.policy.version != 3 and time.monotonic() < deadline:
            sampler.refresh()
            time.sleep(0.1)
        assert stats.versions == [1, 3] and sampler.policy.sha256 == v2.sha256
    finally:
        follower.close()


def test_a_pinned_export_whose_digest_is_not_the_one_given_exits_2_naming_it(workspace, tmp_path):
    path = _config(workspace, "unused", tmp_path / "pinned.yaml")
    data = yaml.safe_load(path.read_text())
    data["policy"] = {"follow": False, "uri": workspace["v1"].uri, "sha256": workspace["v2"].sha256, "version": 1}
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["rollouts", "sample", str(path)])
    assert result.exit_code == 2, result.output
    assert f"policy version 1: {workspace['v1'].path / 'export.json'} hashes to {workspace['v1'].sha256}" in result.output


def test_max_groups_per_version_needs_a_followed_policy_and_is_named_when_set_on_a_pinned_one(tmp_path):
    from ember.inference.config import SamplerConfigError

    example = Path(__file__).resolve().parents[2] / "ember" / "inference" / "sample.example.yaml"
    assert load_config(example).policy.max_groups_per_version is None
    bad = tmp_path / "pinned.yaml"
    data = yaml.safe_load(example.read_text())
    data["policy"] = {"follow": False, "uri": "file:///x", "sha256": "0" * 64, "max_groups_per_version": 2}
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(SamplerConfigError, match="max_groups_per_version waits for newer announced versions: it needs follow: true"):
        load_config(bad)
