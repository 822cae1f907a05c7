"""Order a repository's files so a file's dependencies come before it (DeepSeek-Coder's repository-level order).

Imports are parsed per language: Python by its `import` / `from ... import` lines (absolute and relative, resolved
to the repository's own modules; lines, not `ast`: parsing cost twice the tokenizer's time in bench/bench_code_data.py,
and a line also reads Python 2 or a truncated file), JavaScript/TypeScript (`import ... from`, `require`, dynamic
`import()` of relative paths), Go (import paths whose tail names a package directory), C/C++ (`#include "..."`) and
Java (`import a.b.C;` and `a.b.*`). An import that names no file of the repository (the standard library, a third-party package) adds no edge. Files of
other languages have no edges and so keep path order among the files that are ready.

The order is Kahn's algorithm with a deterministic choice: among the files whose dependencies are all placed, the
smallest path; when none is (an import cycle), the file with the fewest unplaced dependencies, smallest path first,
as DeepSeek-Coder breaks cycles by the lowest in-degree. Every file appears exactly once.
"""

from __future__ import annotations

import heapq
import posixpath
import re
from collections.abc import Mapping, Sequence

PYTHON = (".py", ".pyi")
SCRIPT = (".js", ".jsx", ".mjs", ".cjs", ".ts", ".tsx")
C_FAMILY = (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".hxx")
GO = (".go",)
JAVA = (".java",)

_JS_IMPORT = re.compile(r"""(?:\bimport\s[^'"`;]*?\bfrom\s*|\bimport\s*\(?\s*|\brequire\s*\(\s*|\bexport\s[^'"`;]*?\bfrom\s*)['"]([^'"\n]+)['"]""")
_C_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"\n]+)"', re.MULTILINE)
_GO_IMPORT_BLOCK = re.compile(r"^\s*import\s*\(([^)]*)\)", re.MULTILINE)
_GO_IMPORT_LINE = re.compile(r'^\s*import\s+(?:[\w.]+\s+)?"([^"\n]+)"', re.MULTILINE)
_GO_QUOTED = re.compile(r'"([^"\n]+)"')
_PY_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[\w., \t]+)", re.MULTILINE)
_PY_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w., \t]+)", re.MULTILINE)
_JAVA_IMPORT = re.compile(r"^\s*import\s+(?:static\s+)?([\w.]+?)(\.\*)?\s*;", re.MULTILINE)


def _python_modules(paths: Sequence[str]) -> dict[str, str]:
    """Dotted module name -> path, for every suffix of the path's package chain (a `src/pkg/mod.py` is importable
    as `pkg.mod` once `src` is on sys.path); the shortest path wins a name two files could claim."""
    names: dict[str, str] = {}
    for path in sorted(paths, key=lambda p: (p.count("/"), p)):
        if not path.endswith(PYTHON):
            continue
        parts = path.rsplit(".", 1)[0].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        for start in range(len(parts)):
            names.setdefault(".".join(parts[start:]), path)
    return names


def _names(listed: str) -> list[str]:
    """`b, c as see` or `(b,\n c)` -> [b, c]."""
    return [n.split()[0] for n in listed.strip("()").replace("\\", " ").split(",") if n.split()]


def _python_import_statements(text: str) -> list[tuple[int, str | None, list[str]]]:
    """(level, module, names) of every import statement, found by its line."""
    found: list[tuple[int, str | None, list[str]]] = [(0, None, _names(listed)) for listed in _PY_IMPORT.findall(text)]
    found += [(len(dots), module or None, _names(listed)) for dots, module, listed in _PY_FROM.findall(text)]
    return found


def _python_imports(path: str, text: str, modules: Mapping[str, str]) -> set[str]:
    package = path.rsplit("/", 1)[0].split("/") if "/" in path else []
    found: set[str] = set()

    def add(name: str) -> None:
        while name:
            if name in modules:
                found.add(modules[name])
                return
            name = name.rpartition(".")[0]

    for level, module, names in _python_import_statements(text):
        if module is None and not level:  # import a.b, c
            for name in names:
                add(name)
            continue
        if level:
            base = package[: len(package) - level + 1] if level - 1 <= len(package) else []
            prefix = ".".join([*base, module] if module else base)
        else:
            prefix = module or ""
        for name in names:
            before = len(found)
            add(f"{prefix}.{name}" if prefix else name)
            if len(found) == before and prefix:
                add(prefix)
    return found


def _script_imports(path: str, text: str, files: set[str]) -> set[str]:
    found = set()
    directory = posixpath.dirname(path)
    for spec in _JS_IMPORT.findall(text):
        if not spec.startswith("."):
            continue
        base = posixpath.normpath(posixpath.join(directory, spec))
        candidates = [base, *(base + ext for ext in SCRIPT), *(f"{base}/index{ext}" for ext in SCRIPT)]
        hit = next((c for c in candidates if c in files), None)
        if hit:
            found.add(hit)
    return found


def _c_includes(path: str, text: str, files: set[str], by_tail: Mapping[str, list[str]]) -> set[str]:
    found = set()
    directory = posixpath.dirname(path)
    for spec in _C_INCLUDE.findall(text):
        near = posixpath.normpath(posixpath.join(directory, spec))
        if near in files:
            found.add(near)
            continue
        matches = [f for f in by_tail.get(posixpath.basename(spec), []) if f == spec or f.endswith("/" + spec)]
        if matches:
            found.add(min(matches))
    return found


def _go_imports(text: str, directories: Mapping[str, list[str]]) -> set[str]:
    specs = set(_GO_IMPORT_LINE.findall(text))
    for block in _GO_IMPORT_BLOCK.findall(text):
        specs.update(_GO_QUOTED.findall(block))
    found = set()
    for spec in specs:
        for directory, members in directories.items():
            if directory and (spec == directory or spec.endswith("/" + directory)):
                found.update(members)
    return found


def _java_imports(text: str, files: set[str], java_dirs: Mapping[str, list[str]]) -> set[str]:
    found = set()
    for name, star in _JAVA_IMPORT.findall(text):
        tail = name.replace(".", "/")
        if star:
            found.update(f for d, members in java_dirs.items() if d == tail or d.endswith("/" + tail) for f in members)
        else:
            found.update(f for f in files if f == tail + ".java" or f.endswith(f"/{tail}.java"))
    return found


def dependencies(files: Mapping[str, str]) -> dict[str, set[str]]:
    """path -> the repository files it imports (itself excluded), for the languages above."""
    paths = set(files)
    modules = _python_modules(list(paths))
    by_tail: dict[str, list[str]] = {}
    go_dirs: dict[str, list[str]] = {}
    java_dirs: dict[str, list[str]] = {}
    for p in sorted(paths):
        by_tail.setdefault(posixpath.basename(p), []).append(p)
        if p.endswith(GO) and not p.endswith("_test.go"):
            go_dirs.setdefault(posixpath.dirname(p), []).append(p)
        if p.endswith(JAVA):
            java_dirs.setdefault(posixpath.dirname(p), []).append(p)
    out: dict[str, set[str]] = {}
    for path, text in files.items():
        if path.endswith(PYTHON):
            deps = _python_imports(path, text, modules)
        elif path.endswith(SCRIPT):
            deps = _script_imports(path, text, paths)
        elif path.endswith(C_FAMILY):
            deps = _c_includes(path, text, paths, by_tail)
        elif path.endswith(GO):
            own = posixpath.dirname(path)
            deps = {d for d in _go_imports(text, go_dirs) if posixpath.dirname(d) != own}
        elif path.endswith(JAVA):
            deps = _java_imports(text, paths, java_dirs)
        else:
            deps = set()
        out[path] = deps - {path}
    return out


def dependency_order(files: Mapping[str, str]) -> list[str]:
    """Every path of `files` (path -> text) once, dependencies first; cycles broken by the lowest in-degree."""
    deps = dependencies(files)
    dependents: dict[str, list[str]] = {p: [] for p in files}
    for path, needs in deps.items():
        for need in needs:
            dependents[need].append(path)
    waiting = {p: len(needs) for p, needs in deps.items()}
    heap = [(n, p) for p, n in waiting.items()]
    heapq.heapify(heap)
    order: list[str] = []
    placed: set[str] = set()
    while heap:
        n, path = heapq.heappop(heap)
        if path in placed or waiting[path] != n:
            continue  # a stale entry: the file was placed, or its count fell since it was pushed
        placed.add(path)
        order.append(path)
        for dependent in dependents[path]:
            if dependent not in placed:
                waiting[dependent] -= 1
                heapq.heappush(heap, (waiting[dependent], dependent))
    return order
