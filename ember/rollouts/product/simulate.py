"""Synthetic product traffic: served completions and the long-tailed events users make about them.

Most completions are never acted on; accepts come within seconds, edits and reverts within minutes, "kept" at
an hour. Everything is planned as log timestamps (no sleeps): `time_scale` compresses the delays, so a test
runs an hour-long horizon in a second of log time, and the engine is fed the plan directly or through Kafka.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from ember.configs import StrictModel
from ember.rollouts.product.events import EventKind, ProductEvent, ServedCompletion
from ember.schemas import Rollout

LANGUAGES = ("python", "typescript", "go", "rust")
TASKS = ("inline", "next_edit", "chat")


class ProductTraffic(StrictModel):
    completions: int = Field(1000, ge=1)
    users: int = Field(100, ge=1)
    orgs: int = Field(10, ge=1)
    policy_versions: int = Field(2, ge=1, description="versions served side by side, newest last")
    tokens: int = Field(64, ge=2, description="tokens per completion (prompt + answer)")
    vocab_size: int = Field(32_000, ge=2)
    rate_per_s: float = Field(50.0, gt=0, description="served completions per second of (uncompressed) product time")
    time_scale: float = Field(1.0, gt=0, description="delays divided by this: 3600 plays an hour in a second")
    shown: float = Field(0.8, ge=0, le=1)
    acted: float = Field(0.3, ge=0, le=1, description="share of shown completions the user does anything with")
    kept_minutes: float = Field(60.0, ge=0)
    with_context_text: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Planned:
    """One record to write: which topic role ('served' or 'events'), when (log ms), key and bytes."""

    timestamp_ms: int
    role: str
    key: bytes
    value: bytes
    user_id: str = ""


def _rollout(rng: np.random.Generator, cid: str, session: str, version: int, spec: ProductTraffic, at_us: int) -> Rollout:
    n = spec.tokens
    prompt = n // 2
    mask = np.zeros(n, np.uint8)
    mask[prompt:] = 1
    logprobs = np.where(mask == 1, -rng.exponential(0.5, n), 0.0).astype(np.float32)
    return Rollout(
        rollout_id=cid, group_id=cid, prompt_id=session, policy_version=version, sampler="product", region="prod",
        created_at_us=at_us, tokens=rng.integers(0, spec.vocab_size, n, dtype=np.uint32), loss_mask=mask,
        sampler_logprobs=logprobs, prompt_tokens=prompt,
    )


def plan_traffic(spec: ProductTraffic, start_ms: int = 0) -> list[Planned]:
    """The whole workload in log order (timestamp, then served before events)."""
    rng = np.random.default_rng(spec.seed)
    scale = spec.time_scale
    out: list[tuple[int, int, int, Planned]] = []
    t = float(start_ms)
    for i in range(spec.completions):
        t += rng.exponential(1000.0 / spec.rate_per_s) / scale
        at = int(t)
        cid = f"c{spec.seed}-{i}"
        user = int(rng.integers(spec.users))
        version = spec.policy_versions - 1 if rng.random() < 0.7 else int(rng.integers(spec.policy_versions))
        served = ServedCompletion(
            _rollout(rng, cid, f"s{user}-{i // 8}", version, spec, at * 1000),
            session_id=f"s{user}-{i // 8}",
            context_key=f"{LANGUAGES[i % len(LANGUAGES)]}/{TASKS[int(rng.integers(len(TASKS)))]}",
            user_id=f"u{user}",
            org_id=f"o{user % spec.orgs}",
            context_text=f"def f{i}():\n    return {i}\n" if spec.with_context_text else None,
        )
        out.append((at, 0, len(out), Planned(at, "served", cid.encode(), served.encode(), served.user_id)))

        def event(delay_ms: float, kind: EventKind, **extra) -> None:
            when = at + int(delay_ms / scale)
            value = ProductEvent(cid, kind, **extra).encode()
            out.append((when, 1, len(out), Planned(when, "events", cid.encode(), value, served.user_id)))

        if rng.random() >= spec.shown:
            continue
        shown_after = rng.exponential(300.0)
        event(shown_after, EventKind.SHOWN)
        if rng.random() >= spec.acted:
            continue
        roll = rng.random()
        if roll < 0.6:
            event(shown_after + rng.exponential(3_000.0), EventKind.ACCEPTED)
            if rng.random() < 0.7:
                event(shown_after + spec.kept_minutes * 60_000 + rng.uniform(0, 30_000.0), EventKind.KEPT, kept_minutes=spec.kept_minutes)
        elif roll < 0.85:
            event(shown_after + rng.exponential(60_000.0), EventKind.EDITED, edit_distance=int(rng.integers(1, 80)))
        else:
            event(shown_after + rng.exponential(120_000.0), EventKind.REVERTED)
    heapq.heapify(out)
    return [heapq.heappop(out)[3] for _ in range(len(out))]
