"""Source mixtures by token budget: how many times each document of a source goes into the shard set.

A source's target is its budget (`mixture.budgets`), or its weight's share of what `mixture.total_tokens` leaves
after the budgets. With r = target / available tokens, every document goes in floor(r) times, plus once more when
a seeded hash of its id falls under r - floor(r) (datatrove's and Megatron's up/down-sampling, made a function of
the document id so a rebuild on any runner picks the same documents). Copies after the first carry the id
`<id>#copy<k>`; `base_id` strips it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

COPY_SUFFIX = re.compile(r"#copy[1-9][0-9]*$")


class MixtureError(ValueError):
    """The mixture cannot be planned (a budget names no source, a source with a target has no tokens)."""


@dataclass(frozen=True)
class SourcePlan:
    available: int  # tokens the source's documents hold once
    target: int
    repeats: int
    fraction: float


def plan(available: Mapping[str, int], weights: Mapping[str, float], budgets: Mapping[str, int],
         total_tokens: int | None) -> dict[str, SourcePlan]:
    """Each source's target and its repeats + fraction; a source neither budgeted nor covered by `total_tokens` is
    taken once as it is."""
    unknown = sorted(set(budgets) - set(available))
    if unknown:
        raise MixtureError(f"mixture.budgets names {unknown}, which are not sources with tokens ({sorted(available)})")
    targets = dict(budgets)
    rest = [s for s in available if s not in budgets]
    if total_tokens is not None and rest:
        left = total_tokens - sum(budgets.values())
        if left < 0:
            raise MixtureError(f"mixture.budgets sum to {sum(budgets.values()):,}, more than mixture.total_tokens {total_tokens:,}")
        weight = sum(weights[s] for s in rest)
        for s in rest:
            targets[s] = round(left * weights[s] / weight) if weight else 0
    plans = {}
    for source, tokens in available.items():
        target = targets.get(source, tokens)
        if tokens == 0:
            if target:
                raise MixtureError(f"source {source} has no tokens to fill its target of {target:,}")
            plans[source] = SourcePlan(0, 0, 0, 0.0)
            continue
        ratio = target / tokens
        plans[source] = SourcePlan(tokens, target, math.floor(ratio), ratio - math.floor(ratio))
    return plans


def copies(source_plan: SourcePlan, document_id: str, seed: int) -> int:
    """How many times `document_id` goes in: the repeats, plus one when its seeded draw is under the fraction."""
    if not source_plan.fraction:
        return source_plan.repeats
    digest = hashlib.blake2b(document_id.encode("utf-8"), key=seed.to_bytes(16, "little"), digest_size=8).digest()
    return source_plan.repeats + (int.from_bytes(digest, "little") / 2**64 < source_plan.fraction)


def copy_id(document_id: str, k: int) -> str:
    return document_id if k == 0 else f"{document_id}#copy{k}"


def base_id(document_id: str) -> str:
    """The document id of a copy's id (the id itself for the first copy)."""
    return COPY_SUFFIX.sub("", document_id)
