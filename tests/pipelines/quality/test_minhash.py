"""MinHash math: datatrove's normalization, unbiased Jaccard estimates, LSH band keys."""

from __future__ import annotations

import random
import string

import numpy as np
from datatrove.utils.text import simplify_text
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.pipelines.quality import minhash


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_normalize_equals_datatrove_simplify_text(text: str) -> None:
    assert minhash.normalize(text) == simplify_text(text)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet=string.printable + "\x1c\x1f\x7f", max_size=300)))
def test_word_shingles_equal_the_reference_over_datatrove_simplify_text(text: str) -> None:
    """The byte-level ASCII path and the per-process word-hash memo give the shingles of the plain definition:
    datatrove's simplified words, each blake2b-hashed, windowed."""
    import hashlib

    words = simplify_text(text).split()
    units = np.array([int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") for w in words],
                     dtype=np.uint64)
    assert np.array_equal(minhash.shingles(text, 3), minhash.windows(units, 3))


def _words(rng: random.Random, n: int) -> list[str]:
    vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(3000)]
    return [rng.choice(vocab) for _ in range(n)]


def test_shingles_follow_datatrove_rules() -> None:
    assert minhash.shingles("only four words here", 5).size == 0  # fewer words than n: no signature
    assert minhash.shingles("One, two; THREE four five six!", 5).size == 2
    # reformatting and case do not change the shingle set
    assert minhash.shingle_set("Alpha beta gamma delta epsilon zeta", 5) == minhash.shingle_set("alpha  BETA\ngamma delta, epsilon zeta.", 5)
    assert minhash.shingles("abcdefgh", 3, "char").size == 6


def test_signature_estimates_jaccard_without_bias() -> None:
    rng = random.Random(0)
    a = _words(rng, 400)
    b = list(a)
    for i in rng.sample(range(400), 10):
        b[i] = "qqqqqq"
    ta, tb = " ".join(a), " ".join(b)
    true = minhash.jaccard(minhash.shingle_set(ta, 5), minhash.shingle_set(tb, 5))
    sa, sb = minhash.shingles(ta, 5), minhash.shingles(tb, 5)
    estimates = [minhash.estimated_jaccard(minhash.signature(sa, 112, s), minhash.signature(sb, 112, s)) for s in range(200)]
    standard_error = np.sqrt(true * (1 - true) / 112) / np.sqrt(len(estimates))
    assert abs(np.mean(estimates) - true) < 4 * standard_error
    assert 0.5 * np.sqrt(true * (1 - true) / 112) < np.std(estimates) < 1.5 * np.sqrt(true * (1 - true) / 112)


def test_signatures_and_band_keys_are_deterministic_and_per_band() -> None:
    text = " ".join(_words(random.Random(1), 100))
    sig = minhash.signature(minhash.shingles(text, 5), 112, 1)
    assert sig.dtype == np.uint64 and sig.shape == (112,)
    assert np.array_equal(sig, minhash.signature(minhash.shingles(text, 5), 112, 1))
    assert not np.array_equal(sig, minhash.signature(minhash.shingles(text, 5), 112, 2))
    keys = minhash.band_keys(sig, 14, 8)
    assert len(set(keys)) == 14 and all(len(k) == 18 for k in keys)
    assert keys == minhash.band_keys(sig.copy(), 14, 8)


def test_blocked_minimum_equals_the_full_minimum() -> None:
    hashes = np.random.default_rng(0).integers(0, 2**63, size=10_000, dtype=np.uint64)
    hashes = np.concatenate([hashes, hashes[:3000]])  # repeated n-grams: dropped before the minimum
    seeds = minhash.hash_seeds(16, 3)
    full = minhash.splitmix64(hashes[:, None] ^ seeds[None, :]).min(axis=0)
    assert np.array_equal(minhash.signature(hashes, 16, 3), full)
