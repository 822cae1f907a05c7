"""A real, offline, mixed code + web corpus for the demo and the benchmark (no download needed).

Code: the interpreter's own standard-library source files, one document per file (real code with
the long-tailed size distribution of a repository). Web: real English prose found on the machine -
the Python documentation topics, installed packages' descriptions and docstrings of the standard
library - cut into pages whose lengths follow a log-normal distribution, as crawled pages do.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ember.schemas.documents import Document, documents_to_table


def code_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))


def code_documents(max_files: int | None = None, max_chars: int | None = None) -> list[Document]:
    docs = []
    for path in code_files()[:max_files]:
        text = path.read_text(encoding="utf-8", errors="replace")[:max_chars]
        docs.append(Document(source="code", kind="code", text=text, metadata={"path": path.name, "language": "python"}))
    return docs


def _prose(docstring_files: int | None) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(description) > 200:
            texts.append(description)
    for path in code_files()[:docstring_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        texts.extend(doc for n in nodes if (doc := ast.get_docstring(n)) and len(doc) > 80)
    return texts


def web_documents(
    pages: int, seed: int = 0, median_chars: int = 2500, sigma: float = 1.1, docstring_files: int | None = None
) -> list[Document]:
    """`pages` pages cut from the prose stream at log-normal lengths (cycling it if needed)."""
    stream = "\n\n".join(_prose(docstring_files))
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median_chars), sigma, size=pages).astype(int), 40, len(stream))
    docs, at = [], 0
    for number, n in enumerate(lengths):
        if at + n > len(stream):
            at = int(rng.integers(0, 1000))
        text = stream[at : at + n]
        at += n
        docs.append(Document(source="web", kind="web", text=f"{text}\n[page {number}]", metadata={"url": f"https://example.org/{number}"}))
    return docs


def write_source(path: Path, documents: list[Document], row_group_size: int = 256) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(documents_to_table(documents), path, row_group_size=row_group_size)
    return path
