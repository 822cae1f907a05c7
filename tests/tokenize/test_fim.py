"""Fill-in-the-middle layouts: exact round trip, token-by-token provenance, and the configured rates."""

import math

import numpy as np

from ember.tokenize import fim

IDS = fim.FimIds(prefix=900, middle=901, suffix=902)


def binomial_ok(hits: int, n: int, p: float) -> bool:
    """Within 5 standard deviations: a seeded draw this far off would be a bug, not chance (p < 1e-6)."""
    return abs(hits - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


def test_round_trip_and_provenance_for_every_layout():
    rng = np.random.default_rng(0)
    modes = set()
    for d in range(400):
        head, tail = d % 2, 1
        tokens = rng.integers(0, 800, size=int(rng.integers(1, 40)) + head + tail).astype(np.uint32)
        layout = fim.layout(f"doc-{d}", len(tokens), head, tail, rate=0.7, spm_rate=0.5, seed=11)
        out = fim.apply(tokens, layout, IDS)
        modes.add(layout.mode)
        assert np.array_equal(fim.unfim(out, IDS, head, tail), tokens)
        if layout.mode is None:
            assert out is tokens
            continue
        assert len(out) == len(tokens) + 3
        assert sorted(int(t) for t in out[list(layout.sentinels)]) == [900, 901, 902]
        mapped = [fim.source_index(layout, i) for i in range(len(out))]
        assert sorted(m for m in mapped if m is not None) == list(range(len(tokens)))  # every token once
        for i, m in enumerate(mapped):
            if m is not None:
                assert out[i] == tokens[m]
        assert out[:head].tolist() == tokens[:head].tolist() and out[-1] == tokens[-1]  # framing stays put
    assert modes == {None, "psm", "spm"}


def test_psm_and_spm_orders():
    tokens = np.arange(10, 20, dtype=np.uint32)
    for d in range(200):
        layout = fim.layout(f"d{d}", 10, 0, 0, rate=1.0, spm_rate=0.5, seed=0)
        out = fim.apply(tokens, layout, IDS).tolist()
        if layout.mode == "psm":  # <pre> prefix <suf> suffix <mid> middle
            p, s, m = out.index(900), out.index(902), out.index(901)
            assert p == 0 and out[p + 1:s] + out[m + 1:] + out[s + 1:m] == tokens.tolist()
        else:  # <pre> <suf> suffix <mid> prefix middle
            assert out[:2] == [900, 902]
            m = out.index(901)
            assert out[m + 1:] + out[2:m] == tokens.tolist()


def test_rates_are_within_a_binomial_bound_and_seeded():
    n, rate, spm_rate = 4000, 0.5, 0.3
    layouts = [fim.layout(f"file-{i}", 50, 1, 1, rate, spm_rate, seed=5) for i in range(n)]
    fimmed = [x for x in layouts if x.mode is not None]
    assert binomial_ok(len(fimmed), n, rate)
    assert binomial_ok(sum(x.mode == "spm" for x in fimmed), len(fimmed), spm_rate)
    assert layouts == [fim.layout(f"file-{i}", 50, 1, 1, rate, spm_rate, seed=5) for i in range(n)]
    assert layouts != [fim.layout(f"file-{i}", 50, 1, 1, rate, spm_rate, seed=6) for i in range(n)]
    assert all(fim.layout(f"f{i}", 50, 1, 1, 0.0, 0.5, 5).mode is None for i in range(100))
