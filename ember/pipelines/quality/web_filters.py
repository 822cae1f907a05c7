"""FineWeb's web heuristics, run with datatrove's own filter classes (Gopher repetition + quality, C4, FineWeb).

datatrove's English word splitter is spaCy's blank tokenizer and spaCy is not an ember dependency, so the
filters get `RegexWordTokenizer`: datatrove's own `WhitespaceTokenizer` (regex sentence splitting) with words
split by a regex that, like spaCy, makes punctuation runs separate tokens. The filter logic is datatrove's.
"""

from __future__ import annotations

from collections import Counter

import regex
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.pipeline.filters.c4_filters import CITATION_REGEX, ELLIPSIS, END_PUNCTUATION, POLICY_SUBSTRINGS
from datatrove.pipeline.filters.gopher_repetition_filter import find_duplicates
from datatrove.utils.text import split_into_sentences, split_into_words
from datatrove.utils.word_tokenizers import WhitespaceTokenizer

from ember.pipelines.quality.settings import WEB_FILTER_ORDER, WebFilters

_WORD = regex.compile(r"[\p{L}\p{M}\p{N}_]+(?:['’][\p{L}]+)*|[^\s\p{L}\p{M}\p{N}_]+")

def _n_grams(words: list[str], n: int, sep: str) -> list[str]:
    """datatrove's `sep.join(words[i:i + n])` at every i, built by zip and map in C."""
    return list(map(sep.join, zip(*(words[i:] for i in range(n)))))


def _all_duplicate_chars(words: list[str], n: int) -> int:
    """datatrove's `find_all_duplicate`: characters of n-grams seen before, a repeat skipping its n words; a
    document whose n-grams are all distinct (most of them) is answered by one set, without the walk."""
    grams = _n_grams(words, n, "")
    if len(set(grams)) == len(grams):
        return 0
    unique: set[str] = set()
    repeated, idx = 0, 0
    while idx < len(grams):
        gram = grams[idx]
        if gram in unique:
            repeated += len(gram)
            idx += n
        else:
            unique.add(gram)
            idx += 1
    return repeated


class FastGopherRepetitionFilter(GopherRepetitionFilter):
    """datatrove's Gopher repetition filter with its n-gram counting in C (the same verdicts: a test compares
    them with datatrove's class); it was the largest single cost of a web build."""

    def filter(self, doc: DatatroveDocument) -> bool | tuple[bool, str]:
        text = doc.text
        if not text:
            return False, "empty"
        paragraphs = self.paragraph_exp.split(text.strip())
        paragraphs_duplicates, char_duplicates = find_duplicates(paragraphs)
        if self.dup_para_frac and paragraphs_duplicates / len(paragraphs) > self.dup_para_frac:
            return False, "dup_para_frac"
        if self.dup_para_char_frac and char_duplicates / len(text) > self.dup_para_char_frac:
            return False, "dup_para_char_frac"
        lines = self._line_splitter.split(text)
        line_duplicates, char_duplicates = find_duplicates(lines)
        if self.dup_line_frac and line_duplicates / len(lines) > self.dup_line_frac:
            return False, "dup_line_frac"
        if self.dup_line_char_frac and char_duplicates / len(text) > self.dup_line_char_frac:
            return False, "dup_line_char_frac"
        words = split_into_words(text, self.language)
        for n, n_frac in self.top_n_grams:
            n_grams = _n_grams(words, n, " ")
            if not n_grams:
                continue
            top, count = Counter(n_grams).most_common(1)[0]
            if len(top) * count / len(text) > n_frac:
                return False, f"top_{n}_gram"
        for n, n_frac in self.dup_n_grams:
            if _all_duplicate_chars(words, n) / len(text) > n_frac:
                return False, f"duplicated_{n}_n_grams"
        return True


class FastC4QualityFilter(C4QualityFilter):
    """datatrove's C4 quality filter that stops counting sentences once there are `min_num_sentences` (the count
    only decides `too_few_sentences`); splitting every kept line into sentences was most of its cost."""

    def filter(self, doc: DatatroveDocument) -> bool | tuple[bool, str]:
        lines = doc.text.splitlines() if self.split_paragraph else split_into_sentences(doc.text, self.language)
        num_sentences = 0
        kept_lines = []
        for line in lines:
            line = line.strip()
            words = line.split()
            self.stat_update("line-total")
            if self.max_word_length != -1 and any(len(word) > self.max_word_length for word in words):
                self.stat_update("line-filter-too_long_word")
                continue
            if self.remove_citations:
                line = CITATION_REGEX.sub("", line)
            if self.filter_no_terminal_punct and (not line.endswith(END_PUNCTUATION) or line.endswith(ELLIPSIS)):
                self.stat_update("line-filter-no_terminal_punc")
                continue
            if len(words) < self.min_words_per_line:
                self.stat_update("line-filter-too_few_words")
                continue
            line_l = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in line_l:
                return False, "lorem_ipsum"
            if self.filter_javascript and "javascript" in line_l:
                self.stat_update("line-filter-javascript")
                continue
            if self.filter_curly_bracket and "{" in line:
                return False, "curly_bracket"
            if self.filter_policy and any(p in line_l for p in POLICY_SUBSTRINGS):
                self.stat_update("line-filter-policy")
                continue
            if self.min_num_sentences != -1 and num_sentences < self.min_num_sentences:
                num_sentences += len(split_into_sentences(line, self.language)) if self.split_paragraph else 1
            kept_lines.append(line)
            self.stat_update("line-kept")
        if num_sentences < self.min_num_sentences:
            return False, "too_few_sentences"
        doc.text = ("\n" if self.split_paragraph else " ").join(kept_lines).strip()
        return True


FILTER_CLASSES: dict[str, type[BaseFilter]] = {
    "gopher_repetition": FastGopherRepetitionFilter,
    "gopher_quality": GopherQualityFilter,
    "c4_quality": FastC4QualityFilter,
    "fineweb_quality": FineWebQualityFilter,
}


class RegexWordTokenizer(WhitespaceTokenizer):
    """Words and punctuation runs as tokens, no spaCy; sentences by datatrove's regex splitter."""

    def word_tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text)


class SharedWordsTokenizer(RegexWordTokenizer):
    """`RegexWordTokenizer` that remembers the last text's words: Gopher repetition, Gopher quality and FineWeb
    each split the same document (FineWeb again only when C4 dropped lines), so the stack splits it once."""

    def __init__(self) -> None:
        super().__init__()
        self._text: str | None = None
        self._words: list[str] = []

    def word_tokenize(self, text: str) -> list[str]:
        if text is not self._text and text != self._text:
            self._text, self._words = text, super().word_tokenize(text)
        return list(self._words)  # a copy: a filter may change its list


class WebFilterStack:
    """The enabled datatrove filters in FineWeb's order; build once per worker (DoFn.setup)."""

    def __init__(self, config: WebFilters):
        tokenizer = SharedWordsTokenizer()
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
