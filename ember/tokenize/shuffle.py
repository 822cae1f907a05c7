"""A seeded bijection of [0, n): the global shuffle of packed sequences across shards.

Any worker can compute where sequence g goes from (g, n, seed) alone, so the shuffle needs no
global sort and no worker ever holds the whole order. A balanced Feistel network permutes
[0, 4^h) (4^h >= n); cycle-walking maps values >= n back into range, which keeps it a bijection.
"""

from __future__ import annotations

import hashlib

ROUNDS = 4


class FeistelPermutation:
    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"permutation size must be positive, got {n}")
        self.n = n
        self._half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half) - 1
        self._keyed = hashlib.blake2b(key=seed.to_bytes(16, "little"), digest_size=8)

    def _round(self, r: int, x: int) -> int:
        h = self._keyed.copy()
        h.update(bytes((r,)) + x.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little") & self._mask

    def _encrypt(self, value: int) -> int:
        left, right = value >> self._half, value & self._mask
        for r in range(ROUNDS):
            left, right = right, left ^ self._round(r, right)
        return (left << self._half) | right

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"{index} is outside [0, {self.n})")
        value = self._encrypt(index)
        while value >= self.n:
            value = self._encrypt(value)
        return value
