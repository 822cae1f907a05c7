"""Connected components by large-star/small-star, as a Beam computation on FnApiRunner."""

from __future__ import annotations

import random

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to

from ember.pipelines.quality.components import ConnectedComponents, Unconverged, large_star, small_star


def _components(edges: list[tuple[str, str]]) -> dict[str, str]:
    """Ground truth by union-find: node -> smallest node of its component, for non-root nodes."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {n: find(n) for n in parent if find(n) != n}


def test_star_steps() -> None:
    assert list(large_star("c", ["a", "d", "e", "d"])) == [("d", "a"), ("e", "a")]
    assert list(large_star("a", ["b", "c"])) == [("b", "a"), ("c", "a")]
    assert list(small_star("e", ["c", "b", "c"])) == [("c", "b"), ("e", "b")]
    assert list(small_star("b", [])) == []


def _run(edges: list[tuple[str, str]], rounds: int) -> None:
    expected = sorted(_components(edges).items())
    with beam.Pipeline(runner="FnApiRunner") as p:
        labels = p | beam.Create(edges) | ConnectedComponents(rounds)
        assert_that(labels, equal_to(expected), label="labels")
        assert_that(labels | Unconverged(), equal_to([0]), label="converged")


def test_random_graph_matches_union_find() -> None:
    rng = random.Random(5)
    nodes = [f"n{i:04d}" for i in range(300)]
    edges = [tuple(rng.sample(nodes, 2)) for _ in range(220)]
    _run(edges, rounds=8)


def test_shuffled_chain_converges_within_the_rounds() -> None:
    nodes = [f"n{i:03d}" for i in range(64)]
    random.Random(9).shuffle(nodes)
    _run(list(zip(nodes, nodes[1:])), rounds=8)


def test_too_few_rounds_are_counted_not_hidden() -> None:
    nodes = [f"n{i:03d}" for i in range(64)]
    with beam.Pipeline(runner="FnApiRunner") as p:
        labels = p | beam.Create(list(zip(nodes, nodes[1:]))) | ConnectedComponents(1)
        unconverged = labels | Unconverged()
        assert_that(unconverged | beam.Map(lambda n: n > 0), equal_to([True]))
