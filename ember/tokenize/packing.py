"""Packing math: pure functions from document lengths to fixed-length bins, and bin assembly.

Best-fit-decreasing (Ding et al. 2024, "Fewer Truncations Improve Language Modeling") cuts only
documents longer than L, into L-token chunks plus a remainder, then places pieces longest first
into the open bin with the least room that still fits. Concat-and-chunk lays documents end to end
and cuts every L tokens; it is kept for comparison. Both are deterministic functions of the input
order, and every token of every document lands in exactly one bin.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

Strategy = Literal["best_fit", "concat_chunk"]


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of document `doc` (an index into the packed window's documents)."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Packing:
    bins: list[list[Piece]]  # each bin's pieces in layout order
    seq_len: int

    @property
    def tokens(self) -> int:
        return sum(p.length for b in self.bins for p in b)

    @property
    def padding_tokens(self) -> int:
        return len(self.bins) * self.seq_len - self.tokens

    @property
    def split_documents(self) -> int:
        """Documents whose tokens are spread over more than one bin."""
        bins_of: dict[int, set[int]] = {}
        for index, pieces in enumerate(self.bins):
            for piece in pieces:
                bins_of.setdefault(piece.doc, set()).add(index)
        return sum(1 for bins in bins_of.values() if len(bins) > 1)

    @property
    def fill_ratio(self) -> float:
        return self.tokens / (len(self.bins) * self.seq_len) if self.bins else 1.0


def _check(lengths: Sequence[int], seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    bad = [i for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise ValueError(f"documents {bad[:5]} have no tokens; reject them before packing")


def best_fit_decreasing(lengths: Sequence[int], seq_len: int) -> Packing:
    _check(lengths, seq_len)
    bins: list[list[Piece]] = []
    pieces: list[Piece] = []
    for doc, n in enumerate(lengths):
        full, rest = divmod(n, seq_len)
        bins.extend([Piece(doc, k * seq_len, (k + 1) * seq_len)] for k in range(full))
        if rest:
            pieces.append(Piece(doc, full * seq_len, n))
    pieces.sort(key=lambda p: (-p.length, p.doc))
    # room -> open bins with exactly that much room; `rooms` is the sorted list of non-empty keys,
    # so the best fit is one bisect away (at most seq_len distinct rooms).
    open_bins: dict[int, list[int]] = {}
    rooms: list[int] = []
    for piece in pieces:
        at = bisect.bisect_left(rooms, piece.length)
        if at == len(rooms):
            index, room = len(bins), seq_len
            bins.append([])
        else:
            room = rooms[at]
            index = open_bins[room].pop()
            if not open_bins[room]:
                del open_bins[room]
                rooms.pop(at)
        bins[index].append(piece)
        left = room - piece.length
        if left:
            if left not in open_bins:
                open_bins[left] = []
                bisect.insort(rooms, left)
            open_bins[left].append(index)
    return Packing(bins, seq_len)


def concat_and_chunk(lengths: Sequence[int], seq_len: int) -> Packing:
    _check(lengths, seq_len)
    bins: list[list[Piece]] = [[]]
    room = seq_len
    for doc, n in enumerate(lengths):
        start = 0
        while start < n:
            if room == 0:
                bins.append([])
                room = seq_len
            take = min(room, n - start)
            bins[-1].append(Piece(doc, start, start + take))
            start += take
            room -= take
    return Packing(bins if bins[0] else [], seq_len)


def pack(lengths: Sequence[int], seq_len: int, strategy: Strategy) -> Packing:
    if strategy == "best_fit":
        return best_fit_decreasing(lengths, seq_len)
    if strategy == "concat_chunk":
        return concat_and_chunk(lengths, seq_len)
    raise ValueError(f"unknown packing strategy {strategy!r}; use best_fit or concat_chunk")


@dataclass(frozen=True)
class Segment:
    """One document span of a packed sequence: where it came from, for provenance."""

    document_id: str
    doc_token_start: int
    doc_token_end: int
    tokens: np.ndarray  # the document's tokens [doc_token_start, doc_token_end)


@dataclass(frozen=True)
class PackedRow:
    tokens: np.ndarray  # exactly seq_len tokens, padding at the tail
    cu_seqlens: np.ndarray  # int32 boundaries of the document spans, padding excluded
    segments: list[dict]


def assemble(segments: Sequence[Segment], seq_len: int, pad_id: int) -> PackedRow:
    """Lay out one bin's segments in order and pad the tail to exactly seq_len."""
    lengths = [s.doc_token_end - s.doc_token_start for s in segments]
    for s, n in zip(segments, lengths):
        if n < 1 or len(s.tokens) != n:
            raise ValueError(f"segment of {s.document_id} claims {n} tokens but carries {len(s.tokens)}")
    used = sum(lengths)
    if used > seq_len:
        raise ValueError(f"segments hold {used} tokens, more than seq_len {seq_len}")
    tokens = np.full(seq_len, pad_id, dtype=np.uint32)
    if segments:
        tokens[:used] = np.concatenate([s.tokens for s in segments])
    cu = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    rows = [
        {"document_id": s.document_id, "doc_token_start": s.doc_token_start, "doc_token_end": s.doc_token_end}
        for s in segments
    ]
    return PackedRow(tokens, cu, rows)


def locate(cu_seqlens: Sequence[int], segments: Sequence[dict], position: int) -> tuple[dict, int] | None:
    """The segment holding token `position` of a row and the token's index in its document; None for padding."""
    cu = np.asarray(cu_seqlens)
    if position < 0:
        raise ValueError(f"token position must be >= 0, got {position}")
    if position >= cu[-1]:
        return None
    span = int(np.searchsorted(cu, position, side="right")) - 1
    segment = segments[span]
    return segment, int(segment["doc_token_start"] + position - cu[span])


def window_count(documents: int, window_documents: int) -> int:
    """How many packing windows a source of `documents` documents is spread over."""
    return max(1, -(-documents // window_documents))


def window_of(document_id: str, windows: int, seed: int) -> int:
    """A document's packing window: a seeded hash, so membership never depends on arrival order."""
    digest = hashlib.blake2b(document_id.encode("utf-8"), key=seed.to_bytes(16, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") % windows
