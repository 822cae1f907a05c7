"""A repository document's tokens, and the way back from one of its tokens to a file.

Each part of the rendered document (a header, a file's text) is tokenized on its own and the parts concatenated,
so every file's tokens are exactly that file's own encoding: a token maps back to its file and to a token of the
file, which `inspect --locate` turns into characters. Headers are framing. FIM at `file` level rearranges each
file's tokens (seeded by the file's id), at `repository` level the whole document (seeded by its id). Everything is
a function of the files, the settings and the tokenizer, so `locate` rebuilds the document instead of storing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.pipelines.code.repos import RepoDocument, RepoFile, render
from ember.tokenize import fim

if TYPE_CHECKING:
    from ember.tokenize.config import FimSettings, RepositorySettings
    from ember.tokenize.tokenizers import Tokenizer


@dataclass(frozen=True)
class FileTokens:
    document_id: str
    start: int  # the file's tokens in the repository document's tokens (after file-level FIM)
    end: int
    plain: int  # the file's own token count


@dataclass(frozen=True)
class RepoTokens:
    document: RepoDocument
    tokens: np.ndarray
    files: tuple[FileTokens, ...]
    plain_length: int  # the document's tokens before repository-level FIM


def repository_tokens(source: str, repo: str, files: Sequence[RepoFile], settings: RepositorySettings,
                      tokenizer: Tokenizer, fim_settings: FimSettings | None = None,
                      fim_ids: fim.FimIds | None = None) -> RepoTokens:
    document = render(source, repo, files, settings.order, settings.seed, settings.repo_header, settings.file_header)
    parts = document.parts()
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    arrays = [np.array(head, dtype=np.uint32)]
    at = len(head)
    placed = []
    file_fim = fim_settings if fim_settings is not None and fim_settings.level == "file" else None
    for (document_id, _), ids in zip(parts, tokenizer.encode_ordinary([text for _, text in parts])):
        array = np.array(ids, dtype=np.uint32)
        if document_id is not None:
            plain = len(array)
            if file_fim is not None:
                array = fim.framed(file_fim, array, document_id, 0, 0, fim_ids)
            placed.append(FileTokens(document_id, at, at + len(array), plain))
        arrays.append(array)
        at += len(array)
    arrays.append(np.array(tail, dtype=np.uint32))
    tokens = np.concatenate(arrays)
    plain_length = len(tokens)
    if fim_settings is not None and fim_settings.level == "repository":
        tokens = fim.framed(fim_settings, tokens, document.id, len(head), len(tail), fim_ids)
    return RepoTokens(document, tokens, tuple(placed), plain_length)


def file_token(repo: RepoTokens, index: int, fim_settings: FimSettings | None, head: int, tail: int) -> tuple[str, int] | None:
    """(file document id, index in the file's own tokens) of token `index` of the repository document; None for a
    header, BOS/EOS or FIM sentinel token."""
    if fim_settings is not None and fim_settings.level == "repository":
        layout = fim.layout(repo.document.id, repo.plain_length, head, tail, fim_settings.rate, fim_settings.spm_rate,
                            fim_settings.seed)
        plain = fim.source_index(layout, index)
        if plain is None:
            return None
        index = plain
    for f in repo.files:
        if f.start <= index < f.end:
            within = index - f.start
            if fim_settings is not None and fim_settings.level == "file":
                layout = fim.layout(f.document_id, f.plain, 0, 0, fim_settings.rate, fim_settings.spm_rate, fim_settings.seed)
                within = fim.source_index(layout, within)
                if within is None:
                    return None
            return f.document_id, within
    return None
