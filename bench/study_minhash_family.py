"""MinHash hash families on labelled code near-duplicates: per-row collision rate against the exact Jaccard.

An ideal min-wise family makes row k of two signatures agree with probability J (the pairs' exact Jaccard of their
word 5-gram sets). This study takes the bench's code corpus (bench_corpus_dedup.code_corpus: real source files with
planted near-duplicates), keeps the labelled pairs (planted, J >= the LSH threshold), and for each family computes
many rows over ember's own 64-bit shingle hashes (datatrove's family also over its sha1 shingles, as its pipeline
does). Reported per family: mean(agreement - J) and its standard error taken across rows (pairs share text — one
file in several interpreters' trees — so pairs are not independent; rows of a good family are); mean(band match -
J^8) on the pairs with J < 0.85, what recall depends on; the LSH misses per 112-row seed (14 bands x 8 rows) against
the ideal (1 - J^8)^14; and the CPU cost per distinct n-gram x row in
`minhash.signature`'s blocked, in-place layout. Not a benchmark (no pass/fail, not in `make bench`).

    .venv/bin/python bench/study_minhash_family.py [--code-docs 20000] [--seeds 8] [--families xor_splitmix mersenne32 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_corpus_dedup import BANDS, N_GRAMS, ROWS, THRESHOLD, code_corpus  # noqa: E402
from ember.pipelines.quality.minhash import _BLOCK, hash_seeds, jaccard, shingles, splitmix64, splitmix64_inplace  # noqa: E402

P61 = np.uint64((1 << 61) - 1)
_S32, _S29, _S61 = (np.uint64(s) for s in (32, 29, 61))
_LOW32, _LOW29 = np.uint64(0xFFFFFFFF), np.uint64((1 << 29) - 1)


def _mod_p61(y: np.ndarray, t: np.ndarray) -> None:
    """y <- y mod (2^61 - 1) for any uint64 y, in place: fold the bits above 61, then one conditional subtraction."""
    np.right_shift(y, _S61, out=t)
    y &= P61
    y += t
    np.subtract(y, P61, out=t)
    np.minimum(y, t, out=y)  # y - p wraps above y when y < p


def xor_splitmix(block, params, xb, tb, ub):
    """ember's current family: splitmix64(x ^ s_k)."""
    np.bitwise_xor(block, params[0][None, :], out=xb)
    splitmix64_inplace(xb, tb)


def add_splitmix2(block, params, xb, tb, ub):
    """splitmix64(splitmix64(x) + s_k): the inner mix is per n-gram (done once in `prepare`), the row cost is one mix."""
    np.add(block, params[0][None, :], out=xb)
    splitmix64_inplace(xb, tb)


def double_splitmix(block, params, xb, tb, ub):
    """splitmix64(splitmix64(x ^ s_k) ^ t_k): two rounds, a stand-in for an ideal random function."""
    np.bitwise_xor(block, params[0][None, :], out=xb)
    splitmix64_inplace(xb, tb)
    xb ^= params[1][None, :]
    splitmix64_inplace(xb, tb)


def mersenne32(block, params, xb, tb, ub):
    """(a_k x + b_k) mod (2^61 - 1) exactly, x the shingle's high 32 bits (the textbook 2-universal family), in
    64-bit arithmetic: a = a1 2^32 + a0, a1 x = m_hi 2^29 + m_lo, and 2^61 = 1 mod p."""
    a1, a0, b = params
    np.multiply(block, a1[None, :], out=xb)  # a1 x < 2^61
    np.right_shift(xb, _S29, out=tb)  # m_hi
    xb &= _LOW29
    xb <<= _S32
    xb += tb  # = a1 x 2^32 mod p, < 2^61 + 2^32
    xb += b[None, :]
    np.multiply(block, a0[None, :], out=tb)  # a0 x < 2^64: fold before adding
    np.right_shift(tb, _S61, out=ub)
    tb &= P61
    tb += ub
    xb += tb  # < 2^63
    _mod_p61(xb, tb)


def datatrove64(block, params, xb, tb, ub):
    """((a_k x + b_k) mod 2^64) mod (2^61 - 1): what datatrove computes at precision 64 (uint64 products wrap)."""
    np.multiply(block, params[0][None, :], out=xb)
    xb += params[1][None, :]
    _mod_p61(xb, tb)


def multiply_shift(block, params, xb, tb, ub):
    """(a_k x + b_k) mod 2^64 >> 32 on the shingle's high 32 bits (Dietzfelbinger's multiply-add-shift, 32-bit out)."""
    np.multiply(block, params[0][None, :], out=xb)
    xb += params[1][None, :]
    xb >>= _S32


def _draw(seed: int, rows: int, family: str) -> tuple:
    rng = np.random.default_rng(seed)
    if family in ("xor_splitmix", "add_splitmix2"):
        return (hash_seeds(rows, seed),)
    if family == "double_splitmix":
        return hash_seeds(rows, seed), splitmix64(hash_seeds(rows, seed) ^ np.uint64(0x5555555555555555))
    if family == "mersenne32":
        a = rng.integers(1, int(P61), size=rows, dtype=np.uint64)
        return a >> _S32, a & _LOW32, rng.integers(0, int(P61), size=rows, dtype=np.uint64)
    if family.startswith("datatrove64"):
        state = np.random.RandomState(seed)  # datatrove's own draw for this seed
        return (state.randint(1, int(P61), dtype=np.uint64, size=rows),
                state.randint(0, int(P61), dtype=np.uint64, size=rows))
    if family == "multiply_shift":
        rng = np.random.default_rng([seed, 1])  # not mersenne32's stream: a shared draw makes the two the same function
        return tuple(rng.integers(0, 2**64 - 1, size=rows, dtype=np.uint64, endpoint=True) for _ in range(2))
    raise ValueError(family)


FAMILIES: dict[str, tuple[Callable, Callable[[np.ndarray], np.ndarray]]] = {
    # name: (row function, per-n-gram preparation, done once per document)
    "xor_splitmix": (xor_splitmix, lambda h: h),
    "add_splitmix2": (add_splitmix2, splitmix64),
    "double_splitmix": (double_splitmix, lambda h: h),
    "mersenne32": (mersenne32, lambda h: h >> _S32),
    "datatrove64": (datatrove64, lambda h: h),
    "datatrove64_sha1": (datatrove64, lambda h: h),  # over datatrove's own sha1 shingles
    "multiply_shift": (multiply_shift, lambda h: h >> _S32),
}


def signature(hashes: np.ndarray, params: tuple, rows: int, family: str) -> np.ndarray:
    """minhash.signature's loop with the family's row function."""
    fn, prepare = FAMILIES[family]
    hashes = prepare(np.unique(hashes))
    result = np.full(rows, np.iinfo(np.uint64).max, dtype=np.uint64)
    n = min(_BLOCK, len(hashes))
    x, t, u = (np.empty((n, rows), dtype=np.uint64) for _ in range(3))
    for start in range(0, len(hashes), _BLOCK):
        block = hashes[start : start + _BLOCK, None]
        fn(block, params, x[: len(block)], t[: len(block)], u[: len(block)])
        xb = x[: len(block)]
        np.minimum(result, xb.min(axis=0), out=result)
    return result


def datatrove_shingles(texts: dict[str, str]) -> dict[str, np.ndarray]:
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig

    from ember.pipelines.quality.web_filters import RegexWordTokenizer

    config = MinhashConfig(n_grams=N_GRAMS, num_buckets=BANDS, hashes_per_bucket=ROWS, seed=1,
                           hash_config=HashConfig(precision=64, hash_fc="sha1"))
    stage = MinhashDedupSignature("/tmp/unused-sigs", config=config, language=RegexWordTokenizer())
    return {k: stage.get_shingles(t).reshape(-1) for k, t in texts.items()}


def _se(per_row: np.ndarray) -> float:
    """Standard error of a mean over rows (or bands): the independent draws of a good family."""
    return float(per_row.std(ddof=1) / np.sqrt(len(per_row)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code-docs", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=8, help="112-row signatures per family (seeds 1..N)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    args = p.parse_args()
    rows = BANDS * ROWS
    with tempfile.TemporaryDirectory(prefix="ember-study-") as work:
        _, planted = code_corpus(Path(work) / "code", args.code_docs, 4)
        wanted = {i for pair in planted for i in pair}
        texts = {}
        for path in sorted((Path(work) / "code").glob("*.parquet")):
            for d in pq.read_table(path).to_pylist():
                if d["id"] in wanted:
                    texts[d["id"]] = d["text"]
    ours = {k: shingles(t, N_GRAMS) for k, t in texts.items()}
    theirs = datatrove_shingles(texts) if "datatrove64_sha1" in args.families else {}
    pairs, jac, jac_dt = [], [], []
    for a, b in planted:
        j = jaccard(frozenset(ours[a].tolist()), frozenset(ours[b].tolist()))
        if j >= THRESHOLD:
            pairs.append((a, b))
            jac.append(j)
            if theirs:
                jac_dt.append(jaccard(frozenset(theirs[a].tolist()), frozenset(theirs[b].tolist())))
    jac = np.array(jac)
    docs = sorted({i for pair in pairs for i in pair})
    ideal = ((1 - jac**ROWS) ** BANDS)
    print(f"# {len(texts)} planted-pair documents from {args.code_docs} code files; {len(pairs)} labelled pairs "
          f"(J >= {THRESHOLD:.3f}), mean J {jac.mean():.4f}; {int((jac < 0.85).sum())} with J < 0.85; "
          f"{args.seeds} x {rows} rows per family; ideal misses per seed {ideal.sum():.1f} +- "
          f"{np.sqrt((ideal * (1 - ideal)).sum()):.1f}")
    if theirs:
        print(f"# datatrove's sha1 shingles: mean J {np.mean(jac_dt):.4f} over the same pairs")
    low = jac < 0.85
    per_seed = []
    print("\n| family | mean(agree - J), all | se | mean(agree - J), J < 0.85 | se | mean(band agree - J^8), J < 0.85 | se "
          "| misses per seed (mean, sd) | ns per n-gram x row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in args.families:
        source = theirs if family == "datatrove64_sha1" else ours
        j_ref = np.array(jac_dt) if family == "datatrove64_sha1" else jac
        agree_rows, misses, cpu, cells = [], [], 0.0, 0
        for seed in range(1, args.seeds + 1):
            params = _draw(seed, rows, family)
            start = time.process_time()
            sigs = {d: signature(source[d], params, rows, family) for d in docs}
            cpu += time.process_time() - start
            cells += sum(len(np.unique(source[d])) for d in docs) * rows
            agree = np.array([sigs[a] == sigs[b] for a, b in pairs])  # pairs x rows
            agree_rows.append(agree)
            band_hit = agree.reshape(len(pairs), BANDS, ROWS).all(axis=2).any(axis=1)
            misses.append(int((~band_hit).sum()))
        agree = np.concatenate(agree_rows, axis=1)
        diff = agree - j_ref[:, None]  # pairs x rows
        row_all, row_low = diff.mean(axis=0), diff[low].mean(axis=0)
        # a band matches with probability J^8 when its rows are independent: what recall depends on
        bands = agree.reshape(len(pairs), -1, ROWS).all(axis=2)[low] - (j_ref[low] ** ROWS)[:, None]
        band_low = bands.mean(axis=0)
        print(f"| {family} | {row_all.mean():+.4f} | {_se(row_all):.4f} | {row_low.mean():+.4f} | {_se(row_low):.4f} | "
              f"{band_low.mean():+.4f} | {_se(band_low):.4f} | "
              f"{np.mean(misses):.1f}, {np.std(misses, ddof=1):.1f} | {cpu / cells * 1e9:.2f} |", flush=True)
        per_seed.append(f"{family}: {misses}")
    print("\nmisses per seed (seeds 1..N; seed 1 is the bench's):\n" + "\n".join(per_seed))


if __name__ == "__main__":
    main()
