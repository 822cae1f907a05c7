"""Beam side of repository-level documents in the tokenize pipeline: split a source's rows into repository files
and the rest, then tokenize each repository as one document (ember/pipelines/code/repo_tokens.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.compute as pc

from ember.pipelines.code.repo_tokens import repository_tokens
from ember.pipelines.code.repos import RepoFile
from ember.tokenize import fim
from ember.tokenize.batches import joined, token_batch
from ember.tokenize.config import FimSettings, RepositorySettings, TokenizerConfig
from ember.tokenize.tokenizers import Tokenizer, load_tokenizer


class SplitRepositories(beam.DoFn):
    """A row group in: the rows of this source with the repository field go out one by one, keyed by
    (source, repository), on `FILES`; the other rows stay a row group for the per-document tokenizer (which
    rejects what it must: no id, no text, another source)."""

    FILES = "files"

    def __init__(self, source: str, field: str):
        self._source = source
        self._field = field

    def process(self, table: pa.Table) -> Iterator[Any]:
        repo = pc.struct_field(table.column("metadata"), self._field)
        grouped = pc.and_kleene(pc.and_kleene(pc.is_valid(repo), pc.is_valid(table.column("id"))),
                                pc.and_kleene(pc.is_valid(table.column("text")), pc.equal(table.column("source"), self._source)))
        grouped = pc.fill_null(grouped, False)
        rest = table.filter(pc.invert(grouped))
        if rest.num_rows:
            yield rest
        files = table.filter(grouped)
        paths = pc.struct_field(files.column("metadata"), "path").to_pylist()
        for doc_id, text, name, path in zip(files.column("id").to_pylist(), files.column("text").to_pylist(),
                                            pc.struct_field(files.column("metadata"), self._field).to_pylist(), paths):
            yield beam.pvalue.TaggedOutput(self.FILES, ((self._source, name), (doc_id, path or doc_id, text)))


class TokenizeRepositories(beam.DoFn):
    """One repository's files in; the repository's document out as a batch of one, and its (source, key, ids,
    lengths) on `LENGTHS` (ember/tokenize/batches.py)."""

    LENGTHS = "lengths"

    def __init__(self, tokenizer: TokenizerConfig, settings: RepositorySettings, fim_settings: FimSettings | None,
                 loader: Callable[[TokenizerConfig], Tokenizer] = load_tokenizer):
        self._tokenizer_config = tokenizer
        self._settings = settings
        self._fim = fim_settings
        self._loader = loader  # the tokenize pipeline's: the driver's tokenizer where the worker runs in its process

    def setup(self) -> None:
        self._tokenizer = self._loader(self._tokenizer_config)
        self._fim_ids = fim.resolve_ids(self._fim, self._tokenizer) if self._fim is not None else None

    def process(self, element: tuple[tuple[str, str], Iterable[tuple[str, str, str]]]) -> Iterator[Any]:
        (source, repo), rows = element
        files = [RepoFile(doc_id, path, text) for doc_id, path, text in rows]
        built = repository_tokens(source, repo, files, self._settings, self._tokenizer, self._fim, self._fim_ids)
        tokens, lengths = token_batch(source, [built.document.id], [len(built.tokens)], joined([built.tokens]))
        yield tokens
        yield beam.pvalue.TaggedOutput(self.LENGTHS, lengths)
