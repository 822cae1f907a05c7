"""The product reward: a completion's events folded into features, and a weighted sum of them at its horizon.

A completion nobody acted on has no signal: it is dropped with reason `no_signal`, never scored as a 0 (a 0
would teach the policy that being ignored is average). "Acted on" means any event beyond `shown`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from ember.configs import StrictModel
from ember.rollouts.product.events import EventKind, ProductEvent


class RewardFunction(StrictModel):
    """Weights on a completion's features; the reward is their sum at the horizon."""

    horizon_s: float = Field(3660.0, gt=0, description="the reward is final this long after the completion was shown (log time): an hour's 'kept' plus a minute to deliver it")
    unshown_horizon_s: float = Field(600.0, gt=0, description="a completion never shown is dropped as no_signal this long after it was served")
    accepted: float = Field(1.0, description="weight of 'accepted'")
    edit_distance: float = Field(-0.01, description="weight per character of the largest reported edit distance")
    reverted: float = Field(-1.0, description="weight of 'reverted'")
    kept: float = Field(0.5, description="weight of 'kept' (reported at or after kept_after_min, before the horizon)")
    kept_after_min: float = Field(60.0, ge=0, description="a 'kept' event for fewer minutes than this is no signal")


@dataclass(frozen=True)
class Features:
    """What the events said so far; folding is order-free, so a replay in another interleaving agrees."""

    shown: bool = False
    accepted: bool = False
    edit_distance: int = 0
    edited: bool = False
    reverted: bool = False
    kept: bool = False

    def fold(self, event: ProductEvent, kept_after_min: float) -> "Features":
        kind = event.kind
        return Features(
            shown=self.shown or kind is EventKind.SHOWN,
            accepted=self.accepted or kind is EventKind.ACCEPTED,
            edit_distance=max(self.edit_distance, event.edit_distance or 0),
            edited=self.edited or kind is EventKind.EDITED,
            reverted=self.reverted or kind is EventKind.REVERTED,
            kept=self.kept or (kind is EventKind.KEPT and (event.kept_minutes or 0) >= kept_after_min),
        )

    @property
    def acted_on(self) -> bool:
        return self.accepted or self.edited or self.reverted or self.kept

    def to_bits(self) -> tuple[int, int]:
        """(flag bits, edit distance): two integers for the spill store's row."""
        flags = self.shown | self.accepted << 1 | self.edited << 2 | self.reverted << 3 | self.kept << 4
        return flags, self.edit_distance

    @staticmethod
    def from_bits(flags: int, edit_distance: int) -> "Features":
        return Features(bool(flags & 1), bool(flags & 2), edit_distance, bool(flags & 4), bool(flags & 8), bool(flags & 16))


def evaluate(function: RewardFunction, features: Features) -> float | None:
    """The reward, or None for "no signal" (the caller drops the completion with that reason)."""
    if not features.acted_on:
        return None
    return (
        function.accepted * features.accepted
        + function.edit_distance * features.edit_distance
        + function.reverted * features.reverted
        + function.kept * features.kept
    )
