"""`ember rollouts sample` with `backend: openai_http`: what a real `transformers serve` (the one OpenAI-compatible
server that runs here) can and cannot supply, and rollouts from a server that answers as vLLM does
(tests/inference/engine_server.py) decoded, validated, recomputed by transformers and batched by the real ETL.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from ember.cli import app
from ember.inference.backend import Sampling
from ember.inference.config import SamplerConfigError, load_config
from ember.inference.generate import sampling_logprobs
from ember.inference.policy import load_policy
from ember.midtrain.rl.batch import rl_batch
from ember.rollouts.admin import ensure_topics
from ember.rollouts.batching import resolve_train_batch
from ember.rollouts.config import parse_config
from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.topics import Topics
from ember.rollouts.transport import RewardWriter
from ember.schemas import Reward, decode_train_batch
from ember.tokenize.tokenizers import load_tokenizer
from tests.inference.engine_server import EngineServer
from tests.inference.support import export_version
from tests.inference.test_sampler import _rollouts
from tests.rollouts.etl_support import etl_settings, read_topic
from tests.rollouts.grading.judge_server import JudgeServer
from tests.tokenize.support import train_tokenizer

G = 2
TASKS = [{"prompt_id": "add", "prompt": "def add(a, b):\n"}, {"prompt_id": "sub", "prompt": "def sub(a, b):\n    return"},
         {"prompt_id": "mul", "prompt": "def mul(a, b):\n"}]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("http")
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    return {"root": root, "v1": export_version(root, 1, seed=1), "tokenizer": train_tokenizer(root / "tokenizer.json", vocab_size=512),
            "tasks": tasks}


def _config(workspace: dict, prefix: str, path: Path, **http) -> Path:
    data = {
        "kafka": {"topic_prefix": prefix},
        "tasks": str(workspace["tasks"]),
        "tokenizer": {"name": "byte-bpe", "path": str(workspace["tokenizer"]), "eos_token": "<|endoftext|>"},
        "backend": "openai_http",
        "http": {"model": "tiny-mixtral", "policy_version": 1, "max_concurrency": 3, "retries": 0, **http},
        "generation": {"group_size": G, "batch_size": 2 * G, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8, "seed": 5},
        "run_id": path.stem,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def test_transformers_serve_is_refused_with_one_line_naming_what_it_cannot_supply(kafka, topic_prefix, workspace, tmp_path):
    """The exported tiny Mixtral served by `transformers serve` from its directory: vLLM's return_token_ids is an
    unexpected field (422), a token-id prompt is refused (400), and a text prompt is answered with text only."""
    from transformers import PreTrainedTokenizerFast

    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=1).values()))
    served = Path(shutil.copytree(workspace["v1"].path, tmp_path / "served"))
    PreTrainedTokenizerFast(tokenizer_file=str(workspace["tokenizer"]), eos_token="<|endoftext|>").save_pretrained(served)
    server = JudgeServer(served, tmp_path / "serve.log")
    server.start()
    try:
        answers = {}
        for name, http in {"default": {}, "ids": {"extra_body": {}}, "text": {"extra_body": {}, "prompt_as": "text"}}.items():
            config = _config(workspace, topic_prefix, tmp_path / f"{name}.yaml", base_url=server.url, model=str(served), **http)
            result = CliRunner().invoke(app, ["rollouts", "sample", str(config)])
            assert result.exit_code == 2, result.output
            answers[name] = " ".join(result.output.split())
        where = f"{server.url} ({served})"
        assert f"{where} refused the request (422: Unexpected fields in the request: {{'return_token_ids'}}); prompt_as: token_ids" in answers["default"]
        assert f"{where} refused the request (400: prompt must be a string.); prompt_as: token_ids" in answers["ids"]
        assert (f"{where} answered without the sampled token ids (vLLM: `token_ids` with return_token_ids) and without per-token "
                "log-probs (`logprobs.token_logprobs`) and without the prompt's token ids") in answers["text"]
        assert server.log_tail(60).count('"POST /v1/completions HTTP/1.1" 200 OK') >= 1  # it did answer, with text only
    finally:
        server.kill()
    assert _rollouts(kafka, topic_prefix, 1, timeout_s=2) == []


def test_rollouts_from_a_vllm_shaped_server_carry_its_ids_and_logprobs_and_pass_the_etl(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=1).values()))
    v1 = workspace["v1"]
    config_path = _config(workspace, topic_prefix, tmp_path / "engine.yaml", base_url="http://unused/v1")
    tokenizer = load_tokenizer(load_config(config_path).tokenizer)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    prompts = [bos + ids for ids in tokenizer.encode_ordinary([t["prompt"] for t in TASKS])]
    policy = load_policy(v1.uri, v1.sha256, 1)
    server = EngineServer(policy, "tiny-mixtral", tokenizer.eos_id, tokenizer.pad_id, corrupt_prompts=[prompts[2]])
    server.start()
    try:
        config_path = _config(workspace, topic_prefix, tmp_path / "engine.yaml", base_url=server.url)
        result = CliRunner().invoke(app, ["rollouts", "sample", str(config_path)])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "published 4 rollouts (2 groups" in output and "policy versions 1 (stamped: the server holds the weights), no routed experts" in output
    assert "group engine-e0-mul: dropped, 2 of 2 completions failed; first: request 4: " in output
    assert "a log-prob that is missing, not finite or above 0" in output and "1 groups failed" in output
    assert len(server.requests) == 6 and {r["seed"] for r in server.requests} == set(range(5, 11))
    assert all(r["logprobs"] == 1 and r["return_token_ids"] and isinstance(r["prompt"], list) for r in server.requests)

    rollouts = _rollouts(kafka, topic_prefix, 4)
    assert sorted(r.rollout_id for r in rollouts) == ["engine-e0-add-0", "engine-e0-add-1", "engine-e0-sub-0", "engine-e0-sub-1"]
    sampling = Sampling(0.8, 0.9, 8, eos_id=None, pad_id=0)
    for rollout in rollouts:
        rollout.validate()
        p = rollout.prompt_tokens
        assert rollout.routed_experts is None and (rollout.policy_version, rollout.policy_version_end) == (1, 1)
        assert rollout.tokens[:p].tolist() == prompts[[t["prompt_id"] for t in TASKS].index(rollout.prompt_id)]
        ids = torch.from_numpy(rollout.tokens.astype(np.int64))[None]
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0]
        logp = sampling_logprobs(logits, sampling, 512)[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()[p - 1 :]
        np.testing.assert_allclose(rollout.sampler_logprobs[p:], logp, atol=1e-4)

    with RewardWriter(topic_prefix, bootstrap_servers=kafka) as rewards:
        for i, rollout in enumerate(rollouts):
            rewards.write(Reward(rollout.rollout_id, rollout.group_id, "unit-tests", float(i % 2), 0))
    # The rewards go out after the checks above, which take seconds on a loaded machine: deadlines that outlast them
    # (the test is about what the rollouts carry, not about deadlines).
    etl = parse_config(etl_settings(topic_prefix, partitions=1, groups={"size": G, "quorum": G, "timeout_s": 600},
                                    rewards={"timeout_s": 600, "orphan_timeout_s": 600}, filters={"max_tokens": 64},
                                    batches={"token_budget": 64, "min_fill": 0.1, "max_wait_s": 0.5},
                                    advantages={"drop_zero_variance": False}))
    prepare_topics(etl, create=True)
    EtlService(etl, "http-test").run(until_idle_s=2.0)
    batches = [decode_train_batch(r.value) for r in read_topic(Topics(topic_prefix).train_batches)]
    assert sum(b.num_sequences for b in batches) == 4, "every rollout of both groups batched, none filtered"
    by_id = {r.rollout_id: r for r in rollouts}
    for claim in batches:  # as the trainer reads them: the referenced rollouts, inline, then its RLBatch
        inline = resolve_train_batch(claim, [by_id[i] for i in claim.rollout_ids])
        assert inline.routed_experts is None and rl_batch(inline).routed_experts is None
        np.testing.assert_array_equal(inline.sampler_logprobs, np.concatenate([by_id[i].sampler_logprobs for i in claim.rollout_ids]))


def test_http_settings_are_checked_at_the_edge_and_a_server_that_never_answers_is_exit_1(kafka, topic_prefix, workspace, tmp_path):
    ensure_topics(kafka, list(Topics(topic_prefix).specs(partitions=1).values()))
    path = _config(workspace, topic_prefix, tmp_path / "bad.yaml", base_url="http://127.0.0.1:1/v1")
    result = CliRunner().invoke(app, ["rollouts", "sample", str(path)])
    assert result.exit_code == 1, result.output
    assert "no rollout published: all 3 groups failed; first: group bad-e0-add: dropped, 2 of 2 completions failed; first: " \
           "request 0: APIConnectionError after 0 retries" in " ".join(result.output.split())
    data = yaml.safe_load(path.read_text())
    for change, message in (
        ({"http": {**data["http"], "api_key": "sk-123"}}, "api_key cannot be given in a config"),
        ({"policy": {"follow": True}}, "policy: the openai_http backend samples the weights its server holds"),
        ({"backend": "transformers"}, "http: only read with backend: openai_http"),
        ({"http": None}, "backend: openai_http needs an `http` section"),
    ):
        path.write_text(yaml.safe_dump({**data, **change}))
        with pytest.raises(SamplerConfigError, match=message) as caught:
            load_config(path)
        assert "sk-123" not in str(caught.value)
    path.write_text(yaml.safe_dump({**data, "http": {**data["http"], "api_key_env": "EMBER_TEST_NO_SUCH_KEY"}}))
    result = CliRunner().invoke(app, ["rollouts", "sample", str(path)])
    assert result.exit_code == 2 and "the environment variable EMBER_TEST_NO_SUCH_KEY (api_key_env) is unset or empty" in result.output
