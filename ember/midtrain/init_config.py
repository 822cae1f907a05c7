"""`midtrain init --from-shards`: a training config that fits the shard sets it names.

The keys a shard set decides are taken from its manifest, never typed by hand: `model.tokenizer`,
`model.vocab_size`, `model.seq_len` and `data.shard_sets`. Everything else (architecture, optimizer,
batch sizes) comes from a template config, by default the tiny CPU example, so the written file is a
complete config that `midtrain train` accepts as is and that a user then scales up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.files import is_url
from ember.schemas import Manifest

TEMPLATE = Path(__file__).parent / "examples" / "tiny_cpu.yaml"


class InitError(ValueError):
    """Shard sets that cannot share one config, or a `--from-shards` value that cannot be read."""


@dataclass(frozen=True)
class ShardSetChoice:
    """One `--from-shards` value: a shard set's location and its blend weight (None: by token count)."""

    location: str
    weight: float | None


def parse_choice(value: str) -> ShardSetChoice:
    """`DIR` or `DIR=WEIGHT` (a URL's `=` in a query is not supported: shard-set URLs have none)."""
    location, sep, weight = value.rpartition("=")
    if not sep:
        return ShardSetChoice(value, None)
    try:
        parsed = float(weight)
    except ValueError:
        raise InitError(f"--from-shards {value!r}: the weight after '=' must be a number, got {weight!r}") from None
    if not parsed > 0 or parsed == float("inf"):
        raise InitError(f"--from-shards {value!r}: the weight must be a positive number")
    return ShardSetChoice(location, parsed)


def blend_weights(choices: list[ShardSetChoice], manifests: list[Manifest]) -> list[float]:
    """The weights given, or else each set's share of all tokens (the blend a single concatenated set would have).

    Given for some sets and not others is refused: no rule would say what the missing ones mean.
    """
    given = [c.weight for c in choices]
    if all(w is not None for w in given):
        return [float(w) for w in given]  # type: ignore[arg-type]
    if any(w is not None for w in given):
        raise InitError("give a weight (DIR=WEIGHT) for every --from-shards or for none (then weights follow token counts)")
    tokens = [sum(s.tokens for s in m.sources.values()) for m in manifests]
    if not all(tokens):
        empty = [c.location for c, t in zip(choices, tokens) if not t]
        raise InitError(f"shard sets with no tokens cannot be blended by token count: {empty}; give weights as DIR=WEIGHT")
    total = sum(tokens)
    return [round(t / total, 6) for t in tokens]


def check_one_model(choices: list[ShardSetChoice], manifests: list[Manifest]) -> None:
    """All sets must feed one model: the same tokenizer (by hash), vocabulary and sequence length."""
    first = manifests[0]
    for choice, m in zip(choices[1:], manifests[1:]):
        for what, mine, theirs in (
            ("tokenizer", f"{m.tokenizer.name} ({m.tokenizer.hash})", f"{first.tokenizer.name} ({first.tokenizer.hash})"),
            ("vocab_size", m.tokenizer.vocab_size, first.tokenizer.vocab_size),
            ("seq_len", m.seq_len, first.seq_len),
        ):
            if mine != theirs:
                raise InitError(
                    f"{choice.location} has {what} {mine} but {choices[0].location} has {theirs}: "
                    "one config trains one model; build the sets with the same tokenize settings"
                )


def _relative(location: str, out_dir: Path) -> str:
    """A set inside the config's directory relative to it (configs resolve paths from there, so the two move
    together); any other local set absolute; URLs unchanged."""
    if is_url(location):
        return location
    path, base = Path(location).resolve(), out_dir.resolve()
    return os.path.relpath(path, base) if path.is_relative_to(base) else str(path)


def fitted_config(
    template: dict[str, Any], choices: list[ShardSetChoice], manifests: list[Manifest], out: Path, run_dir: str | None
) -> dict[str, Any]:
    """`template` with the shard-set-derived keys replaced; `run_dir` defaults to runs/<config name> beside `out`."""
    check_one_model(choices, manifests)
    weights = blend_weights(choices, manifests)
    first = manifests[0]
    config = {**template}
    config["run_dir"] = run_dir if run_dir is not None else f"runs/{out.stem}"
    config["model"] = {
        **template.get("model", {}),
        "tokenizer": first.tokenizer.name,
        "vocab_size": first.tokenizer.vocab_size,
        "seq_len": first.seq_len,
    }
    config["data"] = {
        **template.get("data", {}),
        "shard_sets": [{"path": _relative(c.location, out.parent), "weight": w} for c, w in zip(choices, weights)],
    }
    return config
