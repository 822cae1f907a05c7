"""FineWeb's web heuristics, run with datatrove's own filter classes (Gopher repetition + quality, C4, FineWeb).

datatrove's English word splitter is spaCy's blank tokenizer and spaCy is not an ember dependency, so the
filters get `RegexWordTokenizer`: datatrove's own `WhitespaceTokenizer` (regex sentence splitting) with words
split by a regex that, like spaCy, makes punctuation runs separate tokens. The filter logic is datatrove's.
"""

from __future__ import annotations

import regex
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.utils.word_tokenizers import WhitespaceTokenizer

from ember.pipelines.quality.settings import WEB_FILTER_ORDER, WebFilters

_WORD = regex.compile(r"[\p{L}\p{M}\p{N}_]+(?:['’][\p{L}]+)*|[^\s\p{L}\p{M}\p{N}_]+")

FILTER_CLASSES: dict[str, type[BaseFilter]] = {
    "gopher_repetition": GopherRepetitionFilter,
    "gopher_quality": GopherQualityFilter,
    "c4_quality": C4QualityFilter,
    "fineweb_quality": FineWebQualityFilter,
}


class RegexWordTokenizer(WhitespaceTokenizer):
    """Words and punctuation runs as tokens, no spaCy; sentences by datatrove's regex splitter."""

    def word_tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text)


class WebFilterStack:
    """The enabled datatrove filters in FineWeb's order; build once per worker (DoFn.setup)."""

    def __init__(self, config: WebFilters):
        tokenizer = RegexWordTokenizer()
        self.filters: list[tuple[str, BaseFilter]] = [
            (name, FILTER_CLASSES[name](language=tokenizer, **config.validated_params(name)))
            for name in WEB_FILTER_ORDER
            if getattr(config, name).enabled
        ]

    def apply(self, text: str) -> tuple[str | None, str, str]:
        """(text after the filters, "", "") when kept, else (None, "<filter>:<reason>", detail).

        C4's filter also drops lines (as in datatrove), so the kept text can be shorter than the input.
        A filter that raises on odd input rejects the document with the error as detail.
        """
        doc = DatatroveDocument(text=text, id="")
        for name, step in self.filters:
            try:
                kept, reason = get_filter_result(step.filter(doc))
            except Exception as exc:  # datatrove divides by word/line counts that odd text can make zero
                return None, f"{name}:error", f"{type(exc).__name__}: {exc}"
            if not kept:
                return None, f"{name}:{reason or 'dropped'}", ""
        return doc.text, "", ""
