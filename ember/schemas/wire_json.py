"""JSON that arrives from Kafka (the control records of `ember.rollouts.records`): any bytes give a value or a DecodeError."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ember.schemas.errors import DecodeError

MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


def _nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, measured without recursion.

    `json.loads` recurses once per level and hits the interpreter's recursion limit (RecursionError)
    long before memory runs out, so depth is bounded before parsing. Brackets inside strings do not
    count; string literals are removed first (the alternatives of the pattern are disjoint, so the
    scan is linear).
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    structure = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    steps = np.isin(structure, _OPENERS).astype(np.int64) - np.isin(structure, _CLOSERS)
    return int(np.cumsum(steps).max(initial=0))


def _unencodable_string(value: Any) -> str | None:
    """The first string (key or value) in a parsed JSON value that is not valid Unicode, if any.

    JSON escapes can spell lone surrogates (`"\\ud800"`) that no UTF-8 encoder accepts: such an id
    would fail later, far from here, when it becomes a Kafka key or a ledger record.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ascii(item[:40])
    return None


def parse_json(raw: bytes, what: str) -> Any:
    """Parse JSON that came from the wire; raises only DecodeError (a ValueError).

    UTF-8 only (no encoding sniffing), nesting at most MAX_JSON_DEPTH deep, integers of at most 4300
    digits (Python's own limit, otherwise a bare ValueError), every string valid Unicode.
    """
    depth = _nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise DecodeError(f"{what} is nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"{what} is not valid UTF-8 JSON: {exc}") from None
    bad = _unencodable_string(value)
    if bad is not None:
        raise DecodeError(f"{what} holds a string that is not valid Unicode (lone surrogate): {bad}")
    return value
