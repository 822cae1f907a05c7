"""A repository's kept files as one document (StarCoder2's layout by default), with the provenance of each file.

The text is `repo_header` once, then per file `file_header` and the file's text. Each file's text is one `Span`
of the repository document: its characters in the document and the file-level document id they came from, so a
character (and a token, when each part is tokenized on its own, see `parts`) of the repository document maps back
to its file. The headers belong to no file: they are framing, like BOS/EOS.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ember.pipelines.code.dependency_order import dependency_order

Order = Literal["dependency", "random", "path"]
STARCODER2_REPO_HEADER = "<repo_name>{repo}"
STARCODER2_FILE_HEADER = "<file_sep>{path}\n"
REPOSITORY_ID_PREFIX = "repo:"


@dataclass(frozen=True)
class RepoFile:
    document_id: str
    path: str
    text: str


@dataclass(frozen=True)
class Span:
    """Characters [start, end) of the repository document are file `document_id`'s text."""

    document_id: str
    start: int
    end: int


@dataclass(frozen=True)
class RepoDocument:
    id: str
    text: str
    spans: tuple[Span, ...]

    def parts(self) -> list[tuple[str | None, str]]:
        """The text cut at span edges, in order: (file document id, its text) or (None, a header)."""
        out: list[tuple[str | None, str]] = []
        at = 0
        for span in self.spans:
            if span.start > at:
                out.append((None, self.text[at:span.start]))
            out.append((span.document_id, self.text[span.start:span.end]))
            at = span.end
        if at < len(self.text):
            out.append((None, self.text[at:]))
        return out

    def locate(self, char: int) -> tuple[str, int] | None:
        """(file document id, character index in that file) of character `char`; None for a header character."""
        for span in self.spans:
            if span.start <= char < span.end:
                return span.document_id, char - span.start
        return None


def repository_id(source: str, repo: str) -> str:
    return f"{REPOSITORY_ID_PREFIX}{source}/{repo}"


def ordered(files: Sequence[RepoFile], order: Order, seed: int, repo: str) -> list[RepoFile]:
    """The files in `order`; `random` is seeded per repository (StarCoder2), so a rebuild lays them out the same."""
    by_path = sorted(files, key=lambda f: (f.path, f.document_id))
    if order == "path":
        return by_path
    if order == "random":
        digest = hashlib.blake2b(repo.encode("utf-8"), key=seed.to_bytes(16, "little"), digest_size=8).digest()
        shuffled = list(by_path)
        random.Random(int.from_bytes(digest, "little")).shuffle(shuffled)
        return shuffled
    texts = {f.path: f.text for f in by_path}
    index = {f.path: f for f in by_path}
    return [index[p] for p in dependency_order(texts)]


def render(source: str, repo: str, files: Sequence[RepoFile], order: Order = "dependency", seed: int = 0,
           repo_header: str = STARCODER2_REPO_HEADER, file_header: str = STARCODER2_FILE_HEADER) -> RepoDocument:
    """One repository document: the header, then each file's header and text in `order`."""
    pieces = [repo_header.format(repo=repo)]
    at = len(pieces[0])
    spans = []
    for f in ordered(files, order, seed, repo):
        head = file_header.format(path=f.path, repo=repo)
        pieces.append(head)
        at += len(head)
        pieces.append(f.text)
        spans.append(Span(f.document_id, at, at + len(f.text)))
        at += len(f.text)
    return RepoDocument(repository_id(source, repo), "".join(pieces), tuple(spans))
