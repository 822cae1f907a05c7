"""A fastText quality classifier (DCLM's `fasttext_oh_eli5` recipe, FineWeb-Edu's idea with a cheaper model).

The model is a local file, loaded once per Beam worker (the stage's DoFn.setup); nothing is downloaded. fastText
scores one line, so newlines become spaces, as DCLM does before scoring; only the head of a long document is
scored (`max_chars`), which bounds the cost of one document.

fasttext-wheel's Python `predict` wrapper calls `np.array(..., copy=False)`, an error under NumPy 2, so the
scores come from the model's own binding (`FastText.f.predict`), which returns (probability, label) pairs.
"""

from __future__ import annotations

import os

QUALITY_REJECT = "quality_classifier"
SCORE_BINS = 20
SCORE_BIN_PREFIX = "score_bin."


def score_bin_metric(score: float) -> str:
    """The stats.json metric counting scores in [k/20, (k+1)/20): `score_bin.07` is [0.35, 0.40)."""
    return f"{SCORE_BIN_PREFIX}{min(int(score * SCORE_BINS), SCORE_BINS - 1):02d}"


class ClassifierError(ValueError):
    """The model file cannot be loaded, or it has no such label."""


class FastTextScorer:
    def __init__(self, path: str, label: str, max_chars: int):
        import fasttext

        if not os.path.isfile(path):
            raise ClassifierError(f"{path}: no such fastText model file")
        try:
            self._model = fasttext.load_model(path)
        except ValueError as exc:  # fastText raises ValueError for a file that is not a model
            raise ClassifierError(f"{path}: not a fastText model ({exc})") from None
        labels = list(self._model.get_labels())
        if label not in labels:
            raise ClassifierError(f"{path}: the model has no label {label!r}; it has {labels}")
        self._label = label
        self._max_chars = max_chars

    def scores(self, text: str) -> dict[str, float]:
        """Every label's probability for `text`."""
        line = " ".join(text[: self._max_chars].split())
        return {label: min(1.0, float(p)) for p, label in self._model.f.predict(line, -1, 0.0, "replace")}

    def score(self, text: str) -> float:
        """The probability of the configured label."""
        return self.scores(text).get(self._label, 0.0)
