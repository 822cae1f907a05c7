"""`ember corpus inspect --locate`: from a training token back to its document's source and text.

The shard row names the document and the token's index in the document's tokens; the manifest's
`provenance` names where each source's documents are (Document Parquet) and the tokenizer. The
document's row gives its source path/URL (metadata) and its text - redacted, as stored - and the
token's character span is found by encoding prefixes of that text (a binary search: BPE pre-splits
on whitespace and punctuation, so a prefix's token count matches the full encoding's up to the span).
A FIM'd document (the manifest records `fim`) is laid out again from its seeded draws, so a token's
place in the FIM'd order maps back to its place in the text. A repository document's token is traced to
its file by rendering the repository again from its files' rows (ember/pipelines/code/repo_tokens.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from ember.schemas.shards import MANIFEST_FILENAME, Manifest, read_manifest
from ember.pipelines.code.repo_tokens import file_token, repository_tokens
from ember.pipelines.code.repos import REPOSITORY_ID_PREFIX, RepoFile
from ember.tokenize import fim, mixtures
from ember.tokenize.config import FimSettings, RepositorySettings, TokenizerConfig
from ember.tokenize.tokenizers import Tokenizer, load_tokenizer

WINDOW_CHARS = 200


class LocateError(ValueError):
    """The document or its text cannot be found from the shard set's records."""


@dataclass(frozen=True)
class Located:
    document_id: str
    documents_file: str  # the Document Parquet file holding it
    origin: str  # url, or repo/path, or path, from the document's metadata
    span: tuple[int, int] | None  # the token's characters in the text; None for a BOS/EOS token
    framing: str | None  # "BOS" / "EOS" when the token is the document's framing token, "FIM" for a FIM sentinel
    before: str
    token_text: str
    after: str


def manifest_of(shard: Path) -> tuple[Path, Manifest]:
    """The shard set holding `shard`: the nearest directory above it with a manifest."""
    for directory in Path(shard).resolve().parents:
        if (directory / MANIFEST_FILENAME).exists():
            return directory, read_manifest(directory)
    raise LocateError(f"{shard}: no {MANIFEST_FILENAME} in any directory above it")


def find_document(pattern: str, document_id: str) -> tuple[str, dict]:
    """The Document Parquet row with this id among the files `pattern` matches (any Beam filesystem)."""
    paths = sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list)
    if not paths:
        raise LocateError(f"no Document Parquet matches {pattern} any more (moved or deleted since the shard set was written)")
    for path in paths:
        with FileSystems.open(path) as handle:
            table = pq.read_table(handle)  # tokenize needs only id, source and text: metadata may be absent
        rows = table.filter(pc.equal(table["id"], document_id))
        if rows.num_rows:
            row = rows.slice(0, 1).to_pylist()[0]
            return path, {"text": row["text"], "metadata": row.get("metadata")}
    raise LocateError(f"document {document_id} is in none of the {len(paths)} files matching {pattern}")


def origin(metadata: dict | None) -> str:
    metadata = metadata or {}
    if metadata.get("url"):
        return metadata["url"]
    if metadata.get("repo") and metadata.get("path"):
        return f"{metadata['repo']}/{metadata['path']}"
    return metadata.get("path") or "(no url, repo or path in the document's metadata)"


def char_span(tokenizer: Tokenizer, text: str, index: int) -> tuple[int, int]:
    """Characters [start, end) of content token `index`: the longest prefix with at most `index` tokens
    ends where the token starts, the shortest with more than `index` ends where it ends."""

    def count(n: int) -> int:
        return len(tokenizer.encode_ordinary([text[:n]])[0])

    lo, hi = 0, len(text)
    while lo < hi:  # smallest n with count(n) > index
        mid = (lo + hi) // 2
        if count(mid) > index:
            hi = mid
        else:
            lo = mid + 1
    end = lo
    lo, hi = 0, end
    while lo < hi:  # largest n < end with count(n) <= index
        mid = (lo + hi + 1) // 2
        if count(mid) <= index:
            lo = mid
        else:
            hi = mid - 1
    return lo, end


def locate_text(shard: Path, source: str, document_id: str, doc_token: int, window: int = WINDOW_CHARS) -> Located:
    """Source path/URL of the document and the text around token `doc_token` of it."""
    _, manifest = manifest_of(shard)
    provenance = manifest.model_extra.get("provenance") or {}
    pattern = (provenance.get("documents") or {}).get(source)
    if pattern is None or "tokenizer" not in provenance:
        raise LocateError("the manifest records no provenance for its sources (a shard set written before ember recorded it)")
    if manifest.model_extra.get("mixture"):  # a repeated document's copies name it `<id>#copy<k>`
        document_id = mixtures.base_id(document_id)
    tokenizer = load_tokenizer(TokenizerConfig.model_validate(provenance["tokenizer"]))
    if tokenizer.identity.hash != manifest.tokenizer.hash:
        raise LocateError(f"the tokenizer ({tokenizer.identity.source}) changed since the shard set was written")
    if document_id.startswith(REPOSITORY_ID_PREFIX) and manifest.model_extra.get("repositories"):
        return _in_repository(pattern, manifest, tokenizer, document_id, doc_token, window)
    path, row = find_document(pattern, document_id)
    text = row["text"]
    content = len(tokenizer.encode_ordinary([text])[0])
    head = 1 if tokenizer.bos_id is not None else 0
    settings = manifest.model_extra.get("fim")
    if settings:  # the document was FIM'd (or not) by a seeded draw: redo it to map the token to its plain place
        tail = 1 if tokenizer.eos_id is not None else 0
        layout = fim.layout(document_id, head + content + tail, head, tail, settings["rate"], settings["spm_rate"],
                            settings["seed"])
        plain = fim.source_index(layout, doc_token)
        if plain is None:
            return Located(document_id, path, origin(row["metadata"]), None, "FIM", "", "", "")
        doc_token = plain
    index = doc_token - head
    if index < 0 or index >= content:
        framing = "BOS" if index < 0 else "EOS"
        at = 0 if index < 0 else len(text)
        return Located(document_id, path, origin(row["metadata"]), None, framing,
                       text[max(0, at - window):at], "", text[at:at + window])
    start, end = char_span(tokenizer, text, index)
    return Located(document_id, path, origin(row["metadata"]), (start, end), None,
                   text[max(0, start - window):start], text[start:end], text[end:end + window])


def _in_repository(pattern: str, manifest, tokenizer: Tokenizer, document_id: str, doc_token: int, window: int) -> Located:
    """A token of a repository document: the repository is rebuilt from its files' Document rows (the manifest records
    how it was rendered, and FIM'd), which names the file and the token's index in the file's own tokens."""
    source, _, repo = document_id.removeprefix(REPOSITORY_ID_PREFIX).partition("/")
    settings = RepositorySettings.model_validate(manifest.model_extra["repositories"])
    fim_settings = FimSettings.model_validate(manifest.model_extra["fim"]) if manifest.model_extra.get("fim") else None
    files, rows = [], {}
    for path in sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list):
        with FileSystems.open(path) as handle:
            table = pq.read_table(handle, columns=["id", "source", "text", "metadata"])
        mine = table.filter(pc.and_(pc.equal(pc.struct_field(table["metadata"], settings.field), repo),
                                    pc.equal(table["source"], source)))
        for row in mine.to_pylist():
            if row["id"] and row["text"] is not None:
                files.append(RepoFile(row["id"], (row["metadata"] or {}).get("path") or row["id"], row["text"]))
                rows[row["id"]] = (path, row)
    if not files:
        raise LocateError(f"no file of repository {repo} (source {source}) is in the files matching {pattern} any more")
    ids = fim.resolve_ids(fim_settings, tokenizer) if fim_settings is not None else None
    built = repository_tokens(source, repo, files, settings, tokenizer, fim_settings, ids)
    found = file_token(built, doc_token, fim_settings, int(tokenizer.bos_id is not None), int(tokenizer.eos_id is not None))
    if found is None:
        return Located(document_id, pattern, f"repository {repo}", None, "repository header, BOS/EOS or FIM", "", "", "")
    file_id, index = found
    path, row = rows[file_id]
    text = row["text"]
    start, end = char_span(tokenizer, text, index)
    return Located(file_id, path, origin(row["metadata"]), (start, end), None,
                   text[max(0, start - window):start], text[start:end], text[end:end + window])
