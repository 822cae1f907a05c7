"""`product:` section of the ETL config (used when `source: product`), and the limits the join shares with the
group path's `filters` and `batches` sections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from ember.configs import StrictModel
from ember.rollouts.product.baselines import BaselineSettings
from ember.rollouts.product.reward import RewardFunction


class ProductSettings(StrictModel):
    reward: RewardFunction = Field(default_factory=RewardFunction)
    baseline: BaselineSettings = Field(default_factory=BaselineSettings)
    state_dir: Path = Field(Path(".ember/product-state"), description="one SQLite spill store per shard lives here")
    opt_out_file: Path | None = Field(None, description="user:<id> / org:<id> lines, re-read when the file changes")
    opt_out_topic: bool = Field(
        False, description="also follow <prefix>.opt-out (compacted; key user:<id> / org:<id>, a tombstone opts back in)"
    )
    orphan_timeout_s: float = Field(7200.0, gt=0, description="events whose completion never arrives are dropped after this")
    dedup_window_s: float = Field(86400.0, gt=0, description="how long decided completion ids are remembered (duplicates, late events)")


@dataclass(frozen=True)
class JoinLimits:
    """The group path's settings the product join obeys too (built from `EtlConfig.filters` and `.batches`)."""

    vocab_size: int
    max_policy_lag: int | None
    max_tokens: int
    token_budget: int
    min_fill: float = 0.9
    max_wait_s: float = 5.0
    drop_empty: bool = True
    max_message_bytes: int = 48 * 1024 * 1024

    @staticmethod
    def of(config) -> "JoinLimits":
        """From an `EtlConfig` (passed in, not imported: the ETL config imports this package)."""
        f, b = config.filters, config.batches
        return JoinLimits(f.vocab_size, f.max_policy_lag, f.max_tokens, b.token_budget, b.min_fill, b.max_wait_s, f.drop_empty,
                          config.dead_letter.max_message_bytes)
