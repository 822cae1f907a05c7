"""Natural-language ID of web documents with lingua (its models ship in the wheel, so it runs offline).

The detector is restricted to a candidate set (`filters.web.language_id.candidates`): lingua's cost
and its confusions grow with the languages it weighs, and a corpus build knows which ones matter.
It reads the first `max_chars` characters (lingua's n-gram statistics settle long before a page
ends). Building it loads the n-gram models, so `identifier` keeps one per process and settings.
"""

from __future__ import annotations

import functools

from lingua import Language, LanguageDetectorBuilder

UNKNOWN = "unknown"

DEFAULT_CANDIDATES = (
    "en", "zh", "es", "de", "fr", "ru", "ja", "pt", "it", "nl", "pl", "ko", "tr", "vi", "id", "uk", "cs", "sv",
    "ar", "fa", "hi",
)
"""The default candidates: the most frequent languages of Common Crawl (CC-MAIN statistics), English first."""


@functools.cache
def known_codes() -> dict[str, Language]:
    """ISO 639-1 code -> lingua language, for every language lingua ships."""
    return {lang.iso_code_639_1.name.lower(): lang for lang in Language.all()}


def unknown_codes(codes: list[str]) -> list[str]:
    return [c for c in codes if c not in known_codes()]


class LanguageIdentifier:
    """(ISO 639-1 code, confidence) of a text among the candidates; (UNKNOWN, 0.0) when lingua finds none."""

    def __init__(self, candidates: tuple[str, ...], low_accuracy: bool, max_chars: int):
        builder = LanguageDetectorBuilder.from_languages(*(known_codes()[c] for c in candidates))  # two or more
        if low_accuracy:
            builder = builder.with_low_accuracy_mode()
        self._detector = builder.with_preloaded_language_models().build()
        self._max_chars = max_chars

    def identify(self, text: str) -> tuple[str, float]:
        values = self._detector.compute_language_confidence_values(text[: self._max_chars])
        if not values or values[0].value <= 0:
            return UNKNOWN, 0.0
        best = values[0]
        return best.language.iso_code_639_1.name.lower(), round(float(best.value), 4)


@functools.cache
def identifier(candidates: tuple[str, ...], low_accuracy: bool, max_chars: int) -> LanguageIdentifier:
    """One detector per process and settings, shared by the worker's threads (building it loads the models)."""
    return LanguageIdentifier(candidates, low_accuracy, max_chars)


def language_verdict(code: str, score: float, allowed: list[str] | None, min_score: float) -> tuple[str, str]:
    """("", "") when kept, else ("language:<code>", why): a language off the allow-list, or below `min_score`."""
    if allowed is None:
        return "", ""
    if code not in allowed:
        return f"language:{code}", f"detected {code} ({score:.2f}); filters.web.languages allows {', '.join(allowed)}"
    if score < min_score:
        return f"language:{code}", f"{code} with confidence {score:.2f} < filters.web.min_language_score {min_score}"
    return "", ""

