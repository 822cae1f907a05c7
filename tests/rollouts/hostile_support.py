"""Hostile inputs for the issue-17 property tests, cheap to draw: each message is a small tuple of
indexes into fixed tables of hostile values, built with numpy (milliseconds an example).

Only the public codec API is used here; `messages(..., write=...)` lets a test put values on the
wire that `encode` itself refuses to write.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from hypothesis import strategies as st

from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage, input_topics
from ember.schemas import Reward, Rollout, encode
from ember.schemas.rollouts import INT64_MAX, MAX_ID_CHARS
from tests.rollouts.helpers import TOPICS, VOCAB, reward, rollout

GROUPS = ("g0", "g1", "g2")
DEEP, DIGITS = "@@deep", "@@digits"  # a raw writer may splice deep nesting or a 4,301-digit integer here
HOSTILE_TEXT = ("", "g\ud800", "\udc00", "x" * (MAX_ID_CHARS + 1), "nul\x00", "\u202egnp", "g0 ", "é", DEEP, DIGITS)
HOSTILE_INTS = (-1, 2**63, 2**64 + 1, 2**70, -(2**63) - 1, 10**40, INT64_MAX)
HOSTILE_FLOATS = (math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324)
HOSTILE_LOGPROBS = (math.nan, math.inf, -math.inf, 3.0, -1e38)
CORRUPTIONS = ("none", "none", "none", "text", "int", "token", "logprob", "mask")
DAMAGE = ("intact", "intact", "intact", "truncate", "flip", "overwrite", "splice", "append", "bytes")
TEXT_FIELDS = ("group_id", "rollout_id", "prompt_id", "sampler")
INT_FIELDS = ("policy_version", "created_at_us", "prompt_tokens")

REFUSED_BY_WRITER = (ValueError, TypeError, OverflowError)  # a writer may refuse a hostile value; it never reaches the wire


def hostile_rollout(group: int, index: int, corruption: str, pick: int, position: int) -> Rollout:
    """Rollout `index` of group `group` with one field made hostile by `corruption`."""
    r = rollout(GROUPS[group], index, tokens=8 + position % 9)
    n = r.num_tokens
    if corruption == "text":
        setattr(r, TEXT_FIELDS[pick % len(TEXT_FIELDS)], HOSTILE_TEXT[position % len(HOSTILE_TEXT)])
    elif corruption == "int":
        setattr(r, INT_FIELDS[pick % len(INT_FIELDS)], HOSTILE_INTS[position % len(HOSTILE_INTS)])
    elif corruption == "token":
        r.tokens = r.tokens.copy()
        r.tokens[position % n] = (VOCAB, VOCAB - 1, 2**32 - 1, 4_000_000_000)[pick % 4]
    elif corruption == "logprob":
        r.sampler_logprobs = r.sampler_logprobs.copy()
        r.sampler_logprobs[position % n] = HOSTILE_LOGPROBS[pick % len(HOSTILE_LOGPROBS)]
    elif corruption == "mask":
        r.loss_mask = r.loss_mask.copy()
        r.loss_mask[position % n] = 2 + pick % 254
    return r


def hostile_reward(r: Rollout, pick: int, position: int) -> Reward:
    """A reward for `r`: a plain score, an extreme or non-finite one, or a hostile grader or component."""
    rw = reward(r, (0.1, 0.9, 0.4, 0.7, *HOSTILE_FLOATS)[pick % 10], grader=("unit-tests", "judge", "\ud800")[position % 3])
    if pick % 7 == 6:
        rw.components = {"passed": HOSTILE_FLOATS[position % len(HOSTILE_FLOATS)]}
    return rw


def damage(raw: bytes, other: bytes, how: str, seed: int) -> bytes:
    """`raw` as a broken producer, disk or network might deliver it."""
    rng = np.random.default_rng(seed)
    at = int(rng.integers(0, max(len(raw), 1)))
    if how == "truncate":
        return raw[:at]
    if how == "flip" and raw:
        return raw[:at] + bytes([raw[at] ^ (1 << int(rng.integers(0, 8)))]) + raw[at + 1 :]
    if how == "overwrite":
        return raw[:at] + rng.bytes(int(rng.integers(1, 16))) + raw[at + 16 :]
    if how == "splice":
        return raw[:at] + other[int(rng.integers(0, max(len(other), 1))) :]
    if how == "append":
        return raw + rng.bytes(int(rng.integers(1, 64)))
    if how == "bytes":
        return rng.bytes(int(rng.integers(0, 96)))
    return raw


plans = st.tuples(
    st.sampled_from(["rollout", "rollout", "reward", "reward"]),
    st.integers(0, len(GROUPS) - 1),
    st.integers(0, 5),
    st.sampled_from(CORRUPTIONS),
    st.sampled_from(DAMAGE),
    st.integers(0, 2**16),
)


def messages(plan: list[tuple], delays: list[int], write: Callable[[Rollout | Reward], bytes] = encode) -> list[InputMessage]:
    """The plan as a two-topic input log, one message an entry unless `write` refuses the record."""
    topics = input_topics(TOPICS)
    offsets = {ROLLOUTS: 0, REWARDS: 0}
    log: list[InputMessage] = []
    other = encode(rollout("g1", 0, tokens=8))
    now = 0
    for (what, group, index, corruption, how, seed), delay in zip(plan, delays):
        r = hostile_rollout(group, index, corruption, seed, seed >> 4)
        record = hostile_reward(r, seed, seed >> 4) if what == "reward" else r
        try:
            value = write(record)
        except REFUSED_BY_WRITER:
            continue
        role = ROLLOUTS if what == "rollout" else REWARDS
        key = record.group_id.encode("utf-8", errors="surrogatepass") if seed % 11 else bytes([seed % 256])
        now += delay
        log.append(InputMessage(topics[role], 0, offsets[role], now, key, damage(value, other, how, seed)))
        offsets[role] += 1
    return log
