"""mkdocs hooks: serve the README (its guarantees and benchmark claims) as the site's guarantees page, and keep
links to the repository's own files working on both GitHub and the site.

One text, two places: docs/guarantees.md is replaced by README.md at build time. README.md and the guides link
to files of the repository that are not pages of the site (infra/README.md, BENCHMARKS.md, tests, ...); there
such a link becomes its path in code, so `mkdocs build --strict` still fails on any broken link between the
site's own pages.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

REPO_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def _as_path(text: str, target: str) -> str:
    return text if text.strip("`") == target else f"{text} (`{target}`)"


def on_page_markdown(markdown: str, page, config, **_) -> str:
    if page.file.src_uri == "guarantees.md":
        readme = Path(config.config_file_path).parent / "README.md"
        return REPO_LINK.sub(
            lambda m: f"[{m.group(1)}]({m.group(2).removeprefix('docs/')})" if m.group(2).startswith("docs/")
            else _as_path(m.group(1), m.group(2)),
            readme.read_text(),
        )

    def outside_docs(link: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), link.group(2)))
        if not target.startswith("../"):
            return link.group(0)  # a page of the site: mkdocs checks it
        return _as_path(link.group(1), target.removeprefix("../"))

    return REPO_LINK.sub(outside_docs, markdown)
