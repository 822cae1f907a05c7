"""Long-horizon agent episodes through the ETL's engine: 4-segment episodes against single-segment rollouts of
the same total tokens, and the memory held per open episode.

What is measured is the ETL's own work per message, in process and without a broker (`ShardEngine`: decode and
validate each message, join rewards, decide groups, GRPO advantages, pack by-reference batches): the part that
segments change. The broker's bytes are the same for both shapes (the same tokens, plus one small header per
segment); `bench/bench_etl.py` measures those end to end.

- throughput: G groups of 8 samples; the anchor publishes each sample as one rollout of T tokens, ember as an
  episode of 4 segments of T/4 tokens (summaries, tool turns), one reward per sample either way; routed experts
  61 layers x top-8 by default (what a production MoE rollout carries, as in bench_etl.py). Both message
  lists are encoded before the clock starts; each repeat feeds a fresh engine, anchor and ember interleaved;
  medians. Reported: samples/s and tokens/s of each, and ember / anchor (goal >= 0.9).
- memory: N episodes left open (their last segment never comes), N = 0, 64, 128, 256 (rounded to groups of 8): heap held by
  the engine (tracemalloc, after the messages' own references are dropped: what a live ETL keeps while it
  waits), per open episode and per held segment.

    .venv/bin/python bench/bench_episodes.py [--groups 16] [--tokens 8192] [--layers 61] [--repeats 5] [--open 0,64,128,256]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.config import parse_config  # noqa: E402
from ember.rollouts.engine import InputMessage, ShardEngine, input_topics  # noqa: E402
from ember.rollouts.simulate import LARGE_VOCAB, synthetic_episode, synthetic_rollout  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.schemas import Reward, encode  # noqa: E402

TOPICS = Topics("bench")
GROUP_SIZE = 8
SEGMENTS = 4


def config(tokens: int):
    return parse_config(
        {
            "kafka": {"topic_prefix": TOPICS.prefix, "group_id": "bench-etl"},
            "groups": {"size": GROUP_SIZE, "timeout_s": 600},
            "rewards": {"timeout_s": 300, "orphan_timeout_s": 600},
            "filters": {"max_tokens": tokens, "truncated": "keep", "max_policy_lag": None, "vocab_size": LARGE_VOCAB},
            "batches": {"token_budget": GROUP_SIZE * tokens, "min_fill": 0.01, "max_wait_s": 0},
        }
    )


def samples(groups: int, tokens: int, segments: int, layers: int | None, seed: int = 0, *, drop_last: bool = False) -> list:
    """(record, ...) per sample in publish order: its segments (or its one rollout), then its reward."""
    rng = np.random.default_rng(seed)
    records = []
    for g in range(groups):
        for i in range(GROUP_SIZE):
            common = dict(group_id=f"g{g}", prompt_id=f"p{g}", prompt_tokens=256, layers=layers or None, vocab_size=LARGE_VOCAB,
                          finish_reason="stop", region="us-east", created_at_us=0)
            if segments == 1:
                parts = [synthetic_rollout(rng, num_tokens=tokens, rollout_id=f"g{g}-{i}", **common)]
            else:
                parts = synthetic_episode(rng, episode_id=f"g{g}-{i}", segments=segments, num_tokens=tokens // segments, **common)
            if drop_last:
                parts = parts[:-1]
            records += parts
            records.append(Reward(f"g{g}-{i}", f"g{g}", "unit-tests", float(rng.random()), 0, {}))
    return records


def messages_of(records: list):
    """Each record as the consumer would hand it over: one message at a time, in order, offsets per topic."""
    roles = input_topics(TOPICS)
    offsets = {"rollouts": 0, "rewards": 0}
    for record in records:
        role = "rewards" if isinstance(record, Reward) else "rollouts"
        yield InputMessage(roles[role], 0, offsets[role], 0, record.group_id.encode(), encode(record))
        offsets[role] += 1


def messages(records: list) -> list[InputMessage]:
    return list(messages_of(records))


def feed(cfg, batch: list[InputMessage]) -> tuple[float, int]:
    engine = ShardEngine(cfg, 0, TOPICS)
    started = time.perf_counter()
    for message in batch:
        engine.ingest(message)
    output, _snapshot, _marks = engine.checkpoint()
    seconds = time.perf_counter() - started
    return seconds, sum(b.batch.num_sequences for b in output.batches)


def throughput(groups: int, tokens: int, layers: int, repeats: int) -> Figure:
    cfg = config(tokens)
    anchor, ember = messages(samples(groups, tokens, 1, layers)), messages(samples(groups, tokens, SEGMENTS, layers))
    n = groups * GROUP_SIZE
    times: dict[str, list[float]] = {"anchor": [], "ember": []}
    for _ in range(repeats):
        for name, batch in (("anchor", anchor), ("ember", ember)):
            seconds, sequences = feed(cfg, batch)
            assert sequences == (n if name == "anchor" else n * SEGMENTS), (name, sequences)
            times[name].append(seconds)
    a, e = statistics.median(times["anchor"]), statistics.median(times["ember"])
    mb = sum(len(m.value) for m in anchor) / 2**20
    print(f"throughput, {groups} groups x {GROUP_SIZE} samples of {tokens} tokens, routed experts {layers} layers x top-8 "
          f"({mb:.0f} MiB of anchor messages), median of {repeats}:")
    print(f"  anchor 1 rollout/sample     {n / a:8.0f} samples/s {n * tokens / a / 1e6:7.2f} M tokens/s  ({len(anchor)} messages)")
    print(f"  ember  {SEGMENTS} segments/sample    {n / e:8.0f} samples/s {n * tokens / e / 1e6:7.2f} M tokens/s  ({len(ember)} messages)")
    print(f"  ember / anchor: {a / e:.2f}x")
    return Figure("samples/s, 4-segment episodes vs 1 rollout per sample", "samples/s", n / e, n / a,
                  "single-segment rollouts", repeats=repeats, target=0.9)


def memory(tokens: int, layers: int, counts: list[int]) -> None:
    cfg = config(tokens)
    print(f"memory held by open episodes ({SEGMENTS - 1} of {SEGMENTS} segments in, {tokens // SEGMENTS} tokens each):")
    for count in counts:
        records = samples(max(1, count // GROUP_SIZE), tokens, SEGMENTS, layers, drop_last=True) if count else []
        gc.collect()
        tracemalloc.start()
        engine = ShardEngine(cfg, 0, TOPICS)
        for message in messages_of(records):  # encoded here, let go after ingest: a consumer's record, held if needed
            engine.ingest(message)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        open_episodes = sum(len(g.members) for g in engine.groups.values())
        segments = sum(len(m.segments) for g in engine.groups.values() for m in g.members.values())
        wire = sum(len(encode(s.rollout)) for g in engine.groups.values() for m in g.members.values() for s in m.segments.values())
        per = f"{held / open_episodes / 2**20:7.2f} MiB/episode ({wire / max(1, held):.0%} of it the segments' own messages)" if open_episodes else ""
        print(f"  {open_episodes:5d} open episodes {segments:5d} segments held {held / 2**20:9.1f} MiB  {per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=None, help="default: quick 4, full 16")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 3, full 5")
    parser.add_argument("--layers", type=int, default=61, help="MoE layers of routed experts per token (top-8, uint8); 0: none")
    parser.add_argument("--open", default=None, help="open-episode counts for the memory table (quick 0,32; full 0,64,128,256)")
    add_flags(parser)
    args = parser.parse_args()
    groups = args.groups or profile_default(args.profile, 4, 16)
    repeats = args.repeats or profile_default(args.profile, 3, 5)
    counts = args.open or profile_default(args.profile, "0,32", "0,64,128,256")
    figure = throughput(groups, args.tokens, args.layers, repeats)
    memory(args.tokens, args.layers, [int(c) for c in counts.split(",")])
    write_results(args.results, "bench_episodes", args.profile, [figure], groups=groups, tokens=args.tokens,
                  layers=args.layers)


if __name__ == "__main__":
    main()
