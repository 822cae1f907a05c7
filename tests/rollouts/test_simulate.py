"""The load generator's records look like a fleet's: routers never pick an expert twice for a token."""

import uuid
from pathlib import Path

import numpy as np
import pytest
import zstandard
from typer.testing import CliRunner

from ember.rollouts.admin import delete_topics, list_topics
from ember.rollouts.cli import rollouts_app
from ember.rollouts.config import parse_config
from ember.rollouts.etl import EtlService
from ember.rollouts.records import PolicyVersion
from ember.rollouts.simulate import PolicyShape, distinct_top_k, expert_popularity, fitted_shape, latest_policy_version, synthetic_rollout
from ember.schemas.codec import decode_rollout
from ember.rollouts.topics import Topics
from tests.rollouts.etl_support import books, etl_settings, read_topic


@pytest.mark.parametrize("top_k,num_experts", [(1, 1), (2, 4), (2, 6), (8, 256), (8, 512), (16, 16)])
def test_top_k_sets_are_distinct_in_range_and_compact(top_k, num_experts):
    experts = distinct_top_k(np.random.default_rng(top_k), (500, 3), top_k, num_experts)
    assert experts.shape == (500, 3, top_k)
    assert experts.dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    assert int(experts.max()) < num_experts
    assert (np.diff(np.sort(experts, axis=-1), axis=-1) > 0).all()


def test_expert_popularity_is_skewed_per_layer_and_followed_by_the_first_pick():
    experts = distinct_top_k(np.random.default_rng(0), (20_000, 2), 8, 256)
    popularity = expert_popularity(2, 256)
    assert popularity[0].max() > 20 * np.median(popularity[0]), "Zipf-like, not uniform"
    assert popularity[0].argmax() != popularity[1].argmax(), "each layer ranks the experts its own way"
    for layer in range(2):
        first = np.bincount(experts[:, layer, 0], minlength=256) / 20_000
        assert np.abs(first - popularity[layer]).max() < 0.01
        every = np.bincount(experts[:, layer].ravel(), minlength=256)
        assert every.argmax() == popularity[layer].argmax()


def test_routed_experts_are_close_to_incompressible():
    """Real routing is; a start and a stride per token compressed 2.2x and made zstd look free in the ETL bench."""
    experts = distinct_top_k(np.random.default_rng(0), (1024, 61), 8, 256).tobytes()
    assert len(zstandard.ZstdCompressor(level=3).compress(experts)) > 0.95 * len(experts)


def test_impossible_layouts_are_refused():
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        distinct_top_k(np.random.default_rng(0), (4,), 8, 4)
    with pytest.raises(ValueError, match="--num-experts must be >= --top-k"):
        fitted_shape({"top_k": 8, "num_experts": 4}, None)


def test_synthetic_rollout_carries_router_like_experts():
    rollout = synthetic_rollout(np.random.default_rng(1), group_id="g", prompt_id="p", num_tokens=64, layers=61)
    assert rollout.routed_experts.shape == (64, 61, 8)
    assert (np.diff(np.sort(rollout.routed_experts, axis=-1), axis=-1) > 0).all()


@pytest.mark.integration
def test_a_run_on_an_existing_prefix_continues_policy_versions(kafka):
    """A second `simulate` on a prefix announces versions after the first's and uses new ids, so the ETL
    batches its rollouts instead of dropping them as stale (versions restarted at 0) or duplicates."""
    prefix = f"test-sim-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    common = ["--prefix", prefix, "--create-topics", "--partitions", "2", "--group-size", "4", "--tokens", "48", "--length-sigma", "0",
              "--layers", "0", "--time-scale", "inf"]
    try:
        first = CliRunner().invoke(rollouts_app, ["simulate", *common, "--groups", "2", "--policy-versions", "3"])
        assert first.exit_code == 0, first.output
        assert latest_policy_version(topics.policy_versions) == 2
        second = CliRunner().invoke(rollouts_app, ["simulate", *common, "--groups", "3", "--policy-versions", "1"])
        assert second.exit_code == 0, second.output
        assert "at version 2: this run announces 3 onwards" in " ".join(second.output.split()), second.output
        versions = [PolicyVersion.decode(r.value).policy_version for r in read_topic(topics.policy_versions)]
        assert versions == [0, 1, 2, 3]
        config = parse_config(etl_settings(prefix, partitions=2, filters={"max_policy_lag": 1}, rewards={"timeout_s": 3}))
        EtlService(config, "sim-test").run(until_idle_s=2.0)
        found = books(topics)
        second_run = [o for o in found.dropped if o.group_id.startswith("sim-v3-")]
        assert not [o for o in second_run if o.reason in ("stale", "duplicate")], second_run
        assert len([rid for rid in found.batched if rid.startswith("sim-v3-")]) == 3 * 4
    finally:
        delete_topics(kafka, [s.name for s in topics.specs().values()])


def _prefix_topics(kafka: str, prefix: str) -> set[str]:
    return {name for name in list_topics(kafka) if name.startswith(f"{prefix}.")}


RL_TINY = Path(__file__).resolve().parents[2] / "ember" / "midtrain" / "examples" / "rl_tiny_cpu.yaml"
ETL_EXAMPLE = Path(__file__).resolve().parents[2] / "ember" / "rollouts" / "etl.example.yaml"


def test_the_shape_comes_from_the_options_then_the_config_then_the_defaults():
    rl = PolicyShape(512, 2, 2, 4, 64)
    assert fitted_shape({}, None) == PolicyShape()
    assert fitted_shape({}, rl, "rl.yaml") == rl
    assert fitted_shape({"layers": 0}, rl, "rl.yaml").layers is None, "no routed experts fit any config"
    etl = PolicyShape(151_936, None, max_tokens=65_536)
    assert fitted_shape({"layers": 2, "top_k": 2, "num_experts": 4}, etl, "etl.yaml") == PolicyShape(151_936, 2, 2, 4, 65_536)


def test_the_simulator_defaults_the_tiny_rl_example_and_the_etl_example_agree():
    """With no sizing option, `simulate` emits what the tiny RL example trains on and the ETL example accepts."""
    from dataclasses import asdict

    from ember.rollouts.cli import _consumer_shape

    (rl, _, _), _ = _consumer_shape(RL_TINY)
    assert rl == PolicyShape(), "the simulator's defaults are the tiny RL example's policy"
    (etl, where, keys), _ = _consumer_shape(ETL_EXAMPLE)
    defaults = asdict(PolicyShape())
    assert fitted_shape(defaults, etl, where, keys) == PolicyShape(), "the ETL example takes every default rollout"
    assert fitted_shape(defaults, rl, str(RL_TINY)) == PolicyShape()


@pytest.mark.parametrize("given, message", [
    ({"vocab_size": 151_936}, "token ids up to 151,935; model.vocab_size is 512 in rl.yaml"),
    ({"top_k": 4}, "route 2 layers x top-4 of 4 experts; rl.yaml has 2 x top-2 of 4"),
    ({"max_tokens": 128}, "rollouts may be 128 tokens; model.seq_len is 64 in rl.yaml"),
    ({"num_experts": 6, "layers": 0, "vocab_size": 8}, None),
])
def test_a_shape_the_config_cannot_take_names_both_sides(given, message):
    rl = PolicyShape(512, 2, 2, 4, 64)
    keys = {"vocab_size": "model.vocab_size", "max_tokens": "model.seq_len"}
    if message is None:
        assert fitted_shape(given, rl, "rl.yaml", keys).layers is None
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        fitted_shape(given, rl, "rl.yaml", keys)


@pytest.mark.integration
def test_simulate_sized_by_the_rl_example_emits_what_its_policy_takes(kafka):
    prefix = f"test-sim-shape-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    runner = CliRunner()
    try:
        refused = runner.invoke(rollouts_app, ["simulate", "--prefix", prefix, "--config", str(ETL_EXAMPLE), "--vocab-size", "200000"])
        assert refused.exit_code == 2 and "filters.vocab_size is 151,936 in" in " ".join(refused.output.split())
        missing = runner.invoke(rollouts_app, ["simulate", "--config", str(RL_TINY), "--prefix", prefix])
        assert missing.exit_code == 2 and f"topics create --prefix {prefix}`" in " ".join(missing.output.split())
        assert not _prefix_topics(kafka, prefix), "only `topics create` (or --create-topics) makes topics"
        done = runner.invoke(rollouts_app, ["simulate", "--prefix", prefix, "--create-topics", "--config", str(RL_TINY),
                                            "--groups", "2", "--group-size", "4", "--time-scale", "inf"])
        assert done.exit_code == 0, done.output
        rollouts = [decode_rollout(r.value) for r in read_topic(topics.rollouts)]
        assert len(rollouts) == 8
        assert max(int(r.tokens.max()) for r in rollouts) < 512 and max(len(r.tokens) for r in rollouts) <= 64
        assert {r.routed_experts.shape[1:] for r in rollouts} == {(2, 2)} and max(int(r.routed_experts.max()) for r in rollouts) < 4
    finally:
        delete_topics(kafka, [s.name for s in topics.specs().values()])


def test_the_simulator_sends_agent_episodes_with_summaries_tool_turns_one_reward_and_lost_or_late_segments():
    """`--max-segments`: episodes of 1..N valid segments, a reward per episode under its id; segments missing and
    late as asked; the default (1) keeps plain rollouts. Through the engine, every episode is batched whole or dropped whole."""
    from collections import defaultdict

    from ember.rollouts.simulate import WorkloadSpec, plan_workload
    from ember.schemas import Reward, Rollout, decode, encode
    from tests.rollouts.helpers import Log, config, run

    assert all(e.record.episode_id is None for e in plan_workload(WorkloadSpec(groups=2, group_size=2)) if isinstance(e.record, Rollout))
    spec = WorkloadSpec(groups=4, group_size=4, max_segments=8, p_missing_segment=0.1, p_late_segment=0.1, late_delay_s=30, seed=3)
    events = plan_workload(spec)
    segments = defaultdict(list)
    for e in events:
        if isinstance(e.record, Rollout):
            segments[e.record.episode_id].append(decode(encode(e.record)))  # every segment passes the boundary checks
    rewards = [e.record for e in events if isinstance(e.record, Reward)]
    assert len({r.rollout_id for r in rewards}) == len(rewards) == 16, "one reward per episode, under its id"
    assert set(segments) <= {r.rollout_id for r in rewards}
    counts = {max(s.segment_index for s in ep) + 1 for ep in segments.values()}
    assert max(counts) > 4 and min(counts) < 3, counts
    later = [s for ep in segments.values() for s in ep if s.segment_index > 0]
    assert later and all(s.summarises == f"{s.episode_id}-s{s.segment_index - 1}" and s.turns[0].role == "summary" for s in later)
    tools = [t for ep in segments.values() for s in ep for t in s.turns if t.role == "tool"]
    assert tools and all(not s.loss_mask[t.start : t.end].any() for ep in segments.values() for s in ep for t in s.turns if t.role == "tool")
    late = [e for e in events if isinstance(e.record, Rollout) and e.at_s > 30]
    assert late, "some segments arrive late"

    log = Log()
    for e in events:
        if e.role != "policy_versions":
            log.add(e.record, int(e.at_s * 1000))
    done = run(config(groups={"quorum": 2}, filters={"max_tokens": 64, "vocab_size": spec.shape.vocab_size}, batches={"token_budget": 1024}), log.messages, end_ms=200_000)
    batched = {r.rsplit("-s", 1)[0] for r in done.batched_ids}
    dropped = {o.rollout_id.rsplit("-s", 1)[0] for o in done.outcomes if o.kind == "rollout_dropped"}
    assert batched and dropped and not batched & dropped
    assert {o.reason for o in done.outcomes if o.kind == "rollout_dropped"} >= {"episode_incomplete"}
