"""Small product-path fixtures: served completions and events as engine messages, and an engine on a temp store."""

from __future__ import annotations

import numpy as np

from ember.rollouts.product.config import JoinLimits, ProductSettings
from ember.rollouts.product.events import EventKind, ProductEvent, ServedCompletion
from ember.rollouts.product.join import EVENTS, SERVED, Message, ProductJoin
from ember.rollouts.product.store import PendingStore
from ember.schemas import Rollout

LIMITS = JoinLimits(vocab_size=1000, max_policy_lag=2, max_tokens=64, token_budget=64, min_fill=1.0, max_wait_s=1.0)


def served(cid: str, *, user: str = "u1", org: str = "o1", context: str = "py", version: int = 1, fill: int = 7) -> bytes:
    n = 8
    rollout = Rollout(
        rollout_id=cid, group_id=cid, prompt_id="p", policy_version=version, sampler="product", region="prod",
        created_at_us=0, tokens=np.full(n, fill, np.uint32), loss_mask=np.array([0, 0, 0, 0, 1, 1, 1, 1], np.uint8),
        sampler_logprobs=np.array([0, 0, 0, 0, -1, -1, -1, -1], np.float32),
    )
    return ServedCompletion(rollout, session_id="s", context_key=context, user_id=user, org_id=org).encode()


def event(cid: str, kind: EventKind, **extra) -> bytes:
    return ProductEvent(cid, kind, **extra).encode()


class Feed:
    """Numbers each role's messages as a partition would, and feeds them to the engine in call order."""

    def __init__(self, join: ProductJoin):
        self.join = join
        self.offsets = {SERVED: 0, EVENTS: 0}

    def send(self, role: str, at_ms: int, cid: str, value: bytes) -> None:
        self.join.ingest(role, Message(self.offsets[role], at_ms, cid.encode(), value))
        self.offsets[role] += 1

    def served(self, at_ms: int, cid: str, **kw) -> None:
        self.send(SERVED, at_ms, cid, served(cid, **kw))

    def event(self, at_ms: int, cid: str, kind: EventKind, **extra) -> None:
        self.send(EVENTS, at_ms, cid, event(cid, kind, **extra))


def engine(path, settings: ProductSettings | None = None, limits: JoinLimits = LIMITS, **kw) -> ProductJoin:
    return ProductJoin(settings or ProductSettings(), limits, PendingStore(path, durable=False), **kw)
