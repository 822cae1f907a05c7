"""Fill-in-the-middle on a document's tokens (Bavarian et al. 2022; Megatron's fim_dataset, StarCoder's layout).

A document is FIM'd with probability `rate`; then, with probability `spm_rate`, in SPM order, else PSM:

    PSM  <pre> prefix <suf> suffix <mid> middle
    SPM  <pre> <suf> suffix <mid> prefix middle

Split points are two uniform token offsets of the content (BOS/EOS stay where they are). Every choice is a
function of (seed, document id) alone, so a rebuild, and `inspect --locate`, recompute the same layout: the
manifest records the settings, `source_index` maps a FIM'd token back to its index in the plain document, and
`unfim` puts the tokens back in order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from ember.tokenize.config import FimSettings
    from ember.tokenize.tokenizers import Tokenizer

Mode = Literal["psm", "spm"]
_SCALE = float(2**64)


@dataclass(frozen=True)
class FimIds:
    prefix: int
    middle: int
    suffix: int


@dataclass(frozen=True)
class FimLayout:
    """How one document was laid out: its mode (None: left as it was) and where each run of its tokens went:
    output tokens [out_start, out_start + length) are plain tokens [src_start, src_start + length)."""

    mode: Mode | None
    moves: tuple[tuple[int, int, int], ...]  # (out_start, src_start, length)
    sentinels: tuple[int, int, int] = (-1, -1, -1)  # where <pre>, <suf>, <mid> are in the output


def _draws(document_id: str, seed: int) -> tuple[float, float, int, int]:
    digest = hashlib.blake2b(document_id.encode("utf-8"), key=seed.to_bytes(16, "little"), digest_size=32).digest()
    a, b, c, d = (int.from_bytes(digest[i:i + 8], "little") for i in range(0, 32, 8))
    return a / _SCALE, b / _SCALE, c, d


def layout(document_id: str, length: int, head: int, tail: int, rate: float, spm_rate: float, seed: int) -> FimLayout:
    """The FIM layout of a `length`-token document whose first `head` and last `tail` tokens are framing."""
    u_apply, u_spm, r1, r2 = _draws(document_id, seed)
    n = length - head - tail
    if u_apply >= rate or n < 1:
        return FimLayout(None, ((0, 0, length),))
    a, b = sorted((r1 % (n + 1), r2 % (n + 1)))
    pre, mid, suf = (head, a), (head + a, b - a), (head + b, n - b)
    if u_spm < spm_rate:  # head <pre> <suf> suffix <mid> prefix middle tail
        runs = [(0, 0, head), (head + 2, suf[0], suf[1]), (head + 3 + suf[1], pre[0], pre[1]),
                (head + 3 + suf[1] + pre[1], mid[0], mid[1])]
        mode: Mode = "spm"
        sentinels = (head, head + 1, head + 2 + suf[1])
    else:  # head <pre> prefix <suf> suffix <mid> middle tail
        runs = [(0, 0, head), (head + 1, pre[0], pre[1]), (head + 2 + pre[1], suf[0], suf[1]),
                (head + 3 + pre[1] + suf[1], mid[0], mid[1])]
        mode = "psm"
        sentinels = (head, head + 1 + pre[1], head + 2 + pre[1] + suf[1])
    runs.append((length + 3 - tail, length - tail, tail))
    return FimLayout(mode, tuple(r for r in runs if r[2] > 0), sentinels)


def apply(tokens: np.ndarray, fim: FimLayout, ids: FimIds) -> np.ndarray:
    """The document's tokens in `fim`'s layout (the same array when it was left as it was)."""
    if fim.mode is None:
        return tokens
    out = np.empty(len(tokens) + 3, dtype=tokens.dtype)
    for out_start, src_start, n in fim.moves:
        out[out_start:out_start + n] = tokens[src_start:src_start + n]
    out[list(fim.sentinels)] = (ids.prefix, ids.suffix, ids.middle)
    return out


def source_index(fim: FimLayout, index: int) -> int | None:
    """Token `index` of the FIM'd document as an index into the plain one; None for a FIM sentinel."""
    for out_start, src_start, n in fim.moves:
        if out_start <= index < out_start + n:
            return src_start + index - out_start
    return None


def unfim(tokens: np.ndarray, ids: FimIds, head: int, tail: int) -> np.ndarray:
    """The plain document back from its FIM'd tokens alone (tokens without the sentinels pass through)."""
    pre = np.flatnonzero(tokens == ids.prefix)
    if len(pre) == 0:
        return tokens
    suf = int(np.flatnonzero(tokens == ids.suffix)[0])
    mid = int(np.flatnonzero(tokens == ids.middle)[0])
    end = len(tokens) - tail
    if suf == head + 1:  # SPM: the suffix, then prefix + middle together
        return np.concatenate([tokens[:head], tokens[mid + 1:end], tokens[suf + 1:mid], tokens[end:]])
    return np.concatenate([tokens[:head], tokens[head + 1:suf], tokens[mid + 1:end], tokens[suf + 1:mid], tokens[end:]])


def resolve_ids(settings: FimSettings, tokenizer: Tokenizer) -> FimIds:
    """The tokenizer's ids of the configured FIM tokens; `TokenizerLoadError` naming the `fim.` key it lacks."""
    return FimIds(tokenizer.special_token_id("fim.prefix_token", settings.prefix_token),
                  tokenizer.special_token_id("fim.middle_token", settings.middle_token),
                  tokenizer.special_token_id("fim.suffix_token", settings.suffix_token))


def framed(settings: FimSettings, tokens: np.ndarray, document_id: str, head: int, tail: int, ids: FimIds) -> np.ndarray:
    """A framed document's tokens with `settings` applied (one call per document at tokenize time)."""
    return apply(tokens, layout(document_id, len(tokens), head, tail, settings.rate, settings.spm_rate, settings.seed), ids)
