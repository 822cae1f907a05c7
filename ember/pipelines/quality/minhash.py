"""MinHash signatures and LSH band keys: pure numpy functions of (text, parameters).

Text is simplified exactly as datatrove's MinHash stage does (its `simplify_text` with the default
`TextNormConfig`: lower case, punctuation and diacritics removed, numbers folded), then cut into word
or character n-grams. Each n-gram hashes to 64 bits through splitmix64 over its words' blake2b hashes,
and hash function k is splitmix64(x XOR seed_k): a bijection per k, vectorised over all n-grams.
"""

from __future__ import annotations

import hashlib
import re
import struct
import unicodedata
from functools import lru_cache

import numpy as np
from datatrove.utils.text import NUMBERS_PATTERN, PUNCTUATION_TRANS

_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_BLOCK = 1024  # n-grams per block when taking minima: memory BLOCK x num_hashes x 8 bytes, two blocks stay in L2


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a 64-bit bijection with full avalanche), element-wise on uint64."""
    with np.errstate(over="ignore"):
        x = x + _C1
        x = (x ^ (x >> _S30)) * _C2
        x = (x ^ (x >> _S27)) * _C3
        return x ^ (x >> _S31)


def splitmix64_inplace(x: np.ndarray, scratch: np.ndarray) -> None:
    """`splitmix64` on `x` in place, `scratch` (x's shape) holding the shifts: no temporary array per operation."""
    x += _C1
    np.right_shift(x, _S30, out=scratch)
    x ^= scratch
    x *= _C2
    np.right_shift(x, _S27, out=scratch)
    x ^= scratch
    x *= _C3
    np.right_shift(x, _S31, out=scratch)
    x ^= scratch


def normalize(text: str) -> str:
    """Same output as datatrove's `simplify_text(text)` (a test holds them equal), without its slow paths:
    whitespace folded by `str.split`, NFD only off ASCII, and ASCII text cleaned as bytes (`_ascii_words`)."""
    if text.isascii():
        return b" ".join(_ascii_words(text)).decode("ascii")
    text = NUMBERS_PATTERN.sub("0", text.lower())
    text = " ".join(_PUNCTUATION_RUN.sub(" ", text).split())
    return _NON_ASCII_RUN.sub(_without_marks, unicodedata.normalize("NFD", text)).strip()


# datatrove maps every punctuation character to a space, and the words are split on whitespace afterwards, so
# a run of them becomes one space: one regex pass instead of `str.translate`'s dict lookup per character
# (the hypothesis test against `simplify_text` catches a map that stops doing so).
_PUNCTUATION_RUN = re.compile("[" + "".join(re.escape(chr(k)) for k in sorted(PUNCTUATION_TRANS)) + "]+")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")  # combining marks are never ASCII: only these runs are scanned


def _without_marks(match: re.Match) -> str:
    return "".join(c for c in match.group() if unicodedata.category(c) != "Mn")


# On ASCII, datatrove's number pattern (\p{Nd} digits, one separator from a set holding '.' and ',' of ASCII)
# and its punctuation map (every entry below 128 maps to a space) reduce to these byte-level forms, which
# run in C; most of a code corpus, and its longest documents, are ASCII.
_ASCII_NUMBERS = re.compile(rb"[0-9]+(?:[.,][0-9]+)?")
_ASCII_PUNCTUATION = bytes.maketrans(
    bytes(k for k in PUNCTUATION_TRANS if k < 128), bytes(PUNCTUATION_TRANS[k] for k in PUNCTUATION_TRANS if k < 128)
)


def _ascii_words(text: str) -> list[bytes]:
    """The words of `normalize(text)` for ASCII `text`, as bytes."""
    return _ASCII_NUMBERS.sub(b"0", text.lower().encode("ascii")).translate(_ASCII_PUNCTUATION).split()


def _words(text: str) -> list[bytes]:
    if text.isascii():
        return _ascii_words(text)
    return [w.encode("utf-8") for w in normalize(text).split()]


_WORD_HASHES: dict[bytes, int] = {}
_WORD_CACHE_LIMIT = 200_000  # ~40 MB per worker; a corpus's vocabulary repeats across documents


def _word_hashes(words: list[bytes]) -> np.ndarray:
    """64-bit blake2b of each word, memoised per process: a code corpus repeats its identifiers in every file."""
    cache = _WORD_HASHES
    missing = set(words).difference(cache)
    if len(cache) + len(missing) > _WORD_CACHE_LIMIT:
        cache.clear()
        missing = set(words)
    for w in missing:
        cache[w] = int.from_bytes(hashlib.blake2b(w, digest_size=8).digest(), "little")
    return np.fromiter(map(cache.__getitem__, words), dtype=np.uint64, count=len(words))


def shingles(text: str, n_grams: int, kind: str = "word") -> np.ndarray:
    """64-bit hashes of the text's n-grams (empty when the text has fewer than n units, as in datatrove)."""
    if kind == "word":
        units = _word_hashes(_words(text))
    else:
        units = splitmix64(np.frombuffer(normalize(text).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64))
    return windows(units, n_grams)


def windows(units: np.ndarray, n: int) -> np.ndarray:
    """Order-sensitive 64-bit hashes of every run of n consecutive units (empty when fewer than n): the
    shingles of near-dedup and the n-grams of decontamination alike."""
    count = len(units) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = units[:count].copy()
    for j in range(1, n):
        h = splitmix64(h ^ units[j : j + count])
    return h


def shingle_set(text: str, n_grams: int, kind: str = "word") -> frozenset[int]:
    """The exact set MinHash estimates the Jaccard of; the ground truth for benchmarks and tests."""
    return frozenset(shingles(text, n_grams, kind).tolist())


@lru_cache(maxsize=8)
def hash_seeds(num_hashes: int, seed: int) -> np.ndarray:
    return splitmix64(np.arange(num_hashes, dtype=np.uint64) + splitmix64(np.array([seed], dtype=np.uint64)))


def signature_peak_bytes(num_hashes: int) -> int:
    """Working memory `signature` needs per document beyond a sorted copy of its n-gram hashes: two
    BLOCK x num_hashes uint64 blocks, so configs can refuse a hash count no worker can hold."""
    return 2 * _BLOCK * num_hashes * 8


def signature(hashes: np.ndarray, num_hashes: int, seed: int) -> np.ndarray:
    """Per hash function, the minimum over the distinct n-grams: uint64[num_hashes]. splitmix64 runs in place on
    one preallocated block, so the work stays in cache."""
    hashes = np.unique(hashes)  # repeated n-grams (common in code) cannot change a minimum
    seeds = hash_seeds(num_hashes, seed)
    result = np.full(num_hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
    rows = min(_BLOCK, len(hashes))
    x, t = np.empty((rows, num_hashes), dtype=np.uint64), np.empty((rows, num_hashes), dtype=np.uint64)
    for start in range(0, len(hashes), _BLOCK):
        block = hashes[start : start + _BLOCK, None]
        xb, tb = x[: len(block)], t[: len(block)]
        np.bitwise_xor(block, seeds[None, :], out=xb)
        splitmix64_inplace(xb, tb)
        np.minimum(result, xb.min(axis=0), out=result)
    return result


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[bytes]:
    """One LSH bucket key per band: band index + a 16-byte digest of that band's rows."""
    return [
        struct.pack(">H", b) + hashlib.blake2b(sig[b * rows : (b + 1) * rows].tobytes(), digest_size=16).digest()
        for b in range(bands)
    ]


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
