"""The corpus build's decontamination stage: documents holding a benchmark item leave as rejects.

The benchmark items are read once on the driver when the graph is built (a missing or malformed file fails
the build before it starts) and travel inside the DoFn, which builds its index once per worker in `setup`:
the index is small and broadcast, and every document is decided on the worker that holds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ember.pipelines.corpus.config import Decontamination
from ember.pipelines.corpus.formats import Row
from ember.pipelines.corpus.stages import CorpusFn, PerDocument
from ember.pipelines.quality.decontamination import BenchmarkIndex, BenchmarkItem

STAGE = "decontaminate"
REASON_PREFIX = "decontamination:"


def reason(benchmark: str) -> str:
    """The reject reason of a document matching `benchmark` (stats.json counts it as `decontaminate:decontamination:<name>`)."""
    return f"{REASON_PREFIX}{benchmark}"


class DecontaminateDocuments(CorpusFn):
    """Reject a document of a kind in `applies_to` that holds a benchmark prompt or solution; the detail
    names the item and how it matched (`decontamination.Match.detail`)."""

    STAGE = STAGE

    def __init__(self, decontamination: Decontamination, items: list[BenchmarkItem], progress_dir: str | None):
        super().__init__(progress_dir)
        self._config = decontamination
        self._items = items

    def setup(self) -> None:
        super().setup()
        self._index = BenchmarkIndex(self._items, self._config.settings(), self._config.match_fields())
        self._kinds = frozenset(self._config.applies_to)

    def process(self, row: Row) -> Iterator[Any]:
        self.advance()
        found = self._index.match(row["text"]) if row["kind"] in self._kinds else None
        if found is None:
            yield row
            return
        yield self.reject(row, reason(found.benchmark), found.detail())
        yield self.stat(row["source"], f"matched.{found.kind}")


def decontaminate_stage(decontamination: Decontamination, progress_dir: str | None) -> PerDocument:
    """The stage for `ember/pipelines/corpus/pipeline.py`'s list, with the benchmark files read now."""
    return PerDocument(DecontaminateDocuments(decontamination, decontamination.read_items(), progress_dir), counted=True)
