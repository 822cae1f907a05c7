"""Tokenized documents travel the tokenize pipeline's shuffles as batches, never one by one.

A runner pays for every element it moves (coder calls, grouping buffers, data-plane framing), so one element per
document made Beam's bookkeeping the pipeline's largest cost after the tokenizer itself. A batch is one tokenizer
call's documents: their ids, their framed token counts and all their tokens end to end as little-endian uint32
bytes, under a key of its own that the lengths, the placements and the tokens meet on (BENCHMARKS.md "Tokenize +
pack"). The key is random: it only has to be unique, and nothing written depends on it.
"""

from __future__ import annotations

import array
import sys
import uuid
from typing import Iterable

import numpy as np

TOKEN_BYTES = 4
TOKENS, PLACEMENTS = 0, 1  # the two kinds of value joined per batch
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == TOKEN_BYTES)


def concatenated(rows: Iterable[list[int]], head: list[int], tail: list[int]) -> tuple[list[int], bytes]:
    """Each row's framed length (0 for an empty row, which adds nothing) and every non-empty row framed by `head`
    and `tail`, end to end, as little-endian uint32 bytes: one buffer, without an array per row."""
    out = array.array(_UINT32)
    lengths = []
    frame = len(head) + len(tail)
    for row in rows:
        if not row:
            lengths.append(0)
            continue
        out.extend(head)
        out.extend(row)
        out.extend(tail)
        lengths.append(len(row) + frame)
    if sys.byteorder == "big":
        out.byteswap()
    return lengths, out.tobytes()


def joined(arrays: list[np.ndarray]) -> bytes:
    """Token arrays end to end as little-endian uint32 bytes."""
    return np.concatenate(arrays).astype("<u4", copy=False).tobytes() if arrays else b""


def token_batch(source: str, names: list[str], lengths: list[int], data: bytes) -> tuple[tuple, tuple]:
    """The two elements a batch of documents leaves tokenization as: (key, (TOKENS, (names, lengths, data))) for the
    join with its placements, and (source, key, names, lengths) for counting and packing."""
    key = uuid.uuid4().hex
    return (key, (TOKENS, (names, lengths, data))), (source, key, names, lengths)
