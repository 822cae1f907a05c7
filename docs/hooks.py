"""mkdocs hooks: serve the README (its guarantees and benchmark claims) as the site's guarantees page.

One text, two places: docs/guarantees.md is replaced by README.md at build time. README.md links to files
beside it (infra/README.md, BENCHMARKS.md, ...) that are not pages of the site; there such a link becomes its
path in code, so `mkdocs build --strict` still fails on any broken link of the site's own pages.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def _as_path(link: re.Match) -> str:
    text, target = link.group(1), link.group(2)
    return text if text.strip("`") == target else f"{text} (`{target}`)"


def on_page_markdown(markdown: str, page, config, **_) -> str:
    if page.file.src_uri != "guarantees.md":
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return REPO_LINK.sub(_as_path, readme.read_text())
