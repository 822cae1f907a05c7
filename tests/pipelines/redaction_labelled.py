"""The labelled redaction set and its scores, shared by test_redaction.py and bench/bench_redaction.py.

Planted: realistic files (Python, JS, YAML, shell, .env, SQL, JSON, prose) under data/redaction/planted,
each secret written as `⟪type|value⟫`; loading strips the markers and keeps every secret's span.
Clean: hand-written negatives under data/redaction/clean (secret-sounding names without secrets,
templated values, RFC section and version numbers, address-shaped version strings, private addresses)
plus the first standard-library modules of the running Python, read as they are.

Recall: a planted secret counts as removed only if none of it survives anywhere in the output (a short
value whole, a long one as any of its 12-character windows), so a half-redacted key is a miss. False
positives: redactions on the clean files, per file and per 1,000 lines, by type.
"""

from __future__ import annotations

import re
import sysconfig
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data" / "redaction"
_MARKED = re.compile(r"\u27ea(?P<type>[a-z_]+)\|(?P<value>.*?)\u27eb", re.DOTALL)
_WINDOW = 12


@dataclass(frozen=True)
class Secret:
    type: str
    start: int
    end: int
    value: str
    telltales: tuple[str, ...] = ()  # what must not survive: parts of the value found nowhere else in its file


@dataclass(frozen=True)
class Labelled:
    name: str
    text: str
    secrets: tuple[Secret, ...] = ()


def unmark(name: str, marked: str) -> Labelled:
    """The text without its markers, each secret with its span in that text."""
    parts, secrets, at, pos = [], [], 0, 0
    for m in _MARKED.finditer(marked):
        parts.append(marked[pos : m.start()])
        at += m.start() - pos
        value = m.group("value")
        secrets.append(Secret(m.group("type"), at, at + len(value), value))
        parts.append(value)
        at += len(value)
        pos = m.end()
    parts.append(marked[pos:])
    return Labelled(name, "".join(parts), tuple(secrets))


def windows(value: str) -> list[str]:
    """The value, or every 12-character window of a long one."""
    if len(value) <= _WINDOW:
        return [value]
    return [value[i : i + _WINDOW] for i in range(0, len(value) - _WINDOW + 1)]


def _with_telltales(doc: Labelled) -> Labelled:
    """Each secret's windows that occur only inside planted secrets (a PEM block's header line is shared
    with the text around it), so finding one in the output is a leak and nothing else."""
    secrets = []
    for secret in doc.secrets:
        assert doc.text[secret.start : secret.end] == secret.value
        telltales = tuple(
            w for w in windows(secret.value) if doc.text.count(w) == sum(s.value.count(w) for s in doc.secrets)
        )
        assert telltales, f"{doc.name}: {secret.value!r} also occurs outside the planted secrets"
        secrets.append(Secret(secret.type, secret.start, secret.end, secret.value, telltales))
    return Labelled(doc.name, doc.text, tuple(secrets))


def planted() -> list[Labelled]:
    return [_with_telltales(unmark(p.name, p.read_text(encoding="utf-8"))) for p in sorted((DATA / "planted").iterdir())]


def stdlib_files(limit: int) -> list[Path]:
    """The first `limit` top-level modules of this interpreter's standard library, in name order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]


def clean(stdlib_limit: int = 150) -> list[Labelled]:
    docs = [Labelled(p.name, p.read_text(encoding="utf-8")) for p in sorted((DATA / "clean").iterdir())]
    return docs + [Labelled(f"stdlib/{p.name}", p.read_text(encoding="utf-8")) for p in stdlib_files(stdlib_limit)]


@dataclass
class Score:
    planted: int = 0
    removed: int = 0
    missed: list[tuple[str, str, str]] = field(default_factory=list)  # (file, type, value)
    by_type: Counter[str] = field(default_factory=Counter)  # planted per type
    removed_by_type: Counter[str] = field(default_factory=Counter)
    clean_files: int = 0
    clean_lines: int = 0
    false_positives: Counter[str] = field(default_factory=Counter)  # redactions on clean text, by type

    @property
    def recall(self) -> float:
        return self.removed / self.planted

    def precision(self, kind: str | None = None, exclude: frozenset[str] = frozenset()) -> float:
        """Planted secrets removed over those plus the clean set's redactions, of one type or of all but
        `exclude`: the clean files hold no secret, so every redaction there is a wrong one."""
        removed = self.removed if kind is None else self.removed_by_type[kind]
        wrong = sum(n for k, n in self.false_positives.items() if k not in exclude and kind in (None, k))
        return removed / (removed + wrong) if removed + wrong else 1.0

    def fp_per_file(self, exclude: frozenset[str] = frozenset()) -> float:
        return sum(n for k, n in self.false_positives.items() if k not in exclude) / self.clean_files

    def fp_per_kline(self, exclude: frozenset[str] = frozenset()) -> float:
        return 1000 * sum(n for k, n in self.false_positives.items() if k not in exclude) / self.clean_lines


def score(
    redact_text: Callable[[str], str],
    count_hits: Callable[[str], Counter[str]],
    planted_docs: list[Labelled],
    clean_docs: list[Labelled],
) -> Score:
    """Recall of `redact_text` on the planted secrets; `count_hits(text)` gives its redactions by type,
    counted on the clean files as false positives."""
    result = Score()
    for doc in planted_docs:
        out = redact_text(doc.text)
        for secret in doc.secrets:
            result.planted += 1
            result.by_type[secret.type] += 1
            if any(w in out for w in secret.telltales):
                result.missed.append((doc.name, secret.type, secret.value))
            else:
                result.removed += 1
                result.removed_by_type[secret.type] += 1
    for doc in clean_docs:
        result.clean_files += 1
        result.clean_lines += doc.text.count("\n") + 1
        result.false_positives.update(count_hits(doc.text))
    return result
