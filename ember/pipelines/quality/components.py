"""Connected components as alternating large-star / small-star rounds (Kiveris et al., SoCC 2014).

Each round is two GroupByKeys over the current edges: no worker ever holds more than one node's
neighbourhood, and the edge count never exceeds the input's. At convergence every edge is
(node, root) where root, the smallest node of the component, is the component's label: node keys
are built so that the smallest one is the preferred representative.

Beam graphs are static, so the rounds are unrolled (`max_rounds`); the alternation converges in
O(log n) rounds on chains and in one or two on the star-shaped graphs LSH buckets produce.
`Unconverged` counts edges whose parent still has a parent, for stats.json to report.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import apache_beam as beam

Edge = tuple[str, str]


def large_star(node: str, neighbours: Iterable[str]) -> Iterator[Edge]:
    """Link every strictly larger neighbour of `node` to the smallest of its closed neighbourhood."""
    distinct = set(neighbours)
    smallest = min(distinct | {node})
    for v in sorted(distinct):
        if v > node:
            yield v, smallest


def small_star(node: str, smaller: Iterable[str]) -> Iterator[Edge]:
    """`smaller` are node's neighbours below it: link all of them and node itself to their minimum."""
    distinct = set(smaller)
    smallest = min(distinct | {node})
    for v in sorted(distinct | {node}):
        if v != smallest:
            yield v, smallest


def _both_directions(edge: Edge) -> Iterator[Edge]:
    yield edge
    yield edge[1], edge[0]


class ConnectedComponents(beam.PTransform):
    """Undirected edges in; (node, root) out for every node that is not its component's root."""

    def __init__(self, max_rounds: int):
        super().__init__()
        self._rounds = max_rounds

    def expand(self, edges):
        for r in range(self._rounds):
            edges = (
                edges
                | f"Round{r}/Undirected" >> beam.FlatMap(_both_directions)
                | f"Round{r}/GroupNeighbours" >> beam.GroupByKey()
                | f"Round{r}/LargeStar" >> beam.FlatMapTuple(large_star)
                | f"Round{r}/GroupSmaller" >> beam.GroupByKey()
                | f"Round{r}/SmallStar" >> beam.FlatMapTuple(small_star)
            )
        return edges


def _unconverged_parent(grouped: tuple[str, dict[str, list]]) -> int:
    _, sides = grouped
    return len(sides["as_parent"]) if sides["as_child"] and sides["as_parent"] else 0


class Unconverged(beam.PTransform):
    """How many (node, parent) edges point at a parent that is not a root (0 once converged)."""

    def expand(self, labels):
        as_child = labels | "AsChild" >> beam.Map(lambda e: (e[0], None))
        as_parent = labels | "AsParent" >> beam.Map(lambda e: (e[1], None))
        return (
            {"as_child": as_child, "as_parent": as_parent}
            | "Join" >> beam.CoGroupByKey()
            | "Count" >> beam.Map(_unconverged_parent)
            | "Sum" >> beam.CombineGlobally(sum)
        )
