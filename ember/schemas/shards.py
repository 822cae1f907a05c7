"""Training shards: one `PackedSequence` row per fixed-length sequence, and the shard-set manifest.

A shard directory is a finished dataset only when its `manifest.json` exists and validates; the
manifest is written last and atomically (`write_manifest`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ember.files import write_atomically
from ember.schemas.errors import FieldIssue, SchemaValidationError
from ember.schemas.versioning import versioned_schema

PACKED_SEQUENCE_SCHEMA_VERSION = 1
MANIFEST_SCHEMA_VERSION = 1
MANIFEST_FILENAME = "manifest.json"

SEGMENT_TYPE = pa.struct(
    [
        pa.field("document_id", pa.string(), nullable=False),
        pa.field("doc_token_start", pa.int64(), nullable=False),
        pa.field("doc_token_end", pa.int64(), nullable=False),
    ]
)

PACKED_SEQUENCE_SCHEMA = versioned_schema(
    "PackedSequence",
    PACKED_SEQUENCE_SCHEMA_VERSION,
    [
        pa.field("tokens", pa.list_(pa.uint32()), nullable=False),
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("segments", pa.list_(SEGMENT_TYPE), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8())),
    ],
)


def packed_sequence_issues(
    tokens: np.ndarray, cu_seqlens: np.ndarray, segments: list[dict], seq_len: int
) -> list[FieldIssue]:
    """Invariants of one packed row: fixed length, monotone boundaries, one segment per document span."""
    issues: list[FieldIssue] = []
    if len(tokens) != seq_len:
        issues.append(FieldIssue("tokens", f"length {len(tokens)} != seq_len {seq_len}"))
    cu = np.asarray(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        issues.append(FieldIssue("cu_seqlens", "must start at 0 and hold at least one boundary"))
    elif np.any(np.diff(cu) <= 0) or cu[-1] > seq_len:
        issues.append(FieldIssue("cu_seqlens", f"must be strictly increasing and end <= {seq_len}"))
    elif len(segments) != len(cu) - 1:
        issues.append(
            FieldIssue("segments", f"{len(segments)} segments for {len(cu) - 1} document spans in cu_seqlens")
        )
    else:
        for i, seg in enumerate(segments):
            span = int(cu[i + 1] - cu[i])
            if seg["doc_token_end"] - seg["doc_token_start"] != span:
                issues.append(FieldIssue(f"segments[{i}]", f"token range does not match span {span}"))
    return issues


class TokenizerIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    hash: str = Field(min_length=8, description="hash of the tokenizer's files")
    vocab_size: int = Field(gt=0)
    source: str | None = Field(default=None, description="where it was loaded from: package, cache repo@commit or file")
    file_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="sha256 of the BPE / tokenizer.json file alone"
    )


class SourceStats(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: int = Field(ge=0)
    tokens: int = Field(ge=0, description="document tokens, padding excluded")
    sequences: int = Field(ge=0)
    padding_tokens: int = Field(ge=0)
    split_documents: int = Field(default=0, ge=0)
    mixture_weight: float | None = Field(default=None, ge=0, description="the weight the config gave this source")
    realised_weight: float | None = Field(
        default=None, ge=0, le=1, description="this source's share of the set's document tokens: what the weight became"
    )
    # With a token-budget mixture (ember/tokenize/mixtures.py): the plan `tokens` realised.
    available_tokens: int | None = Field(default=None, ge=0, description="the source's tokens taken once")
    target_tokens: int | None = Field(default=None, ge=0)
    repeats: int | None = Field(default=None, ge=0, description="copies every document gets")
    fraction: float | None = Field(default=None, ge=0, lt=1, description="share of documents given one more copy")


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, description="relative to the manifest's directory")
    rows: int = Field(gt=0)
    bytes: int = Field(gt=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _inside_the_set(cls, path: str) -> str:
        """A normalized relative POSIX name: every reader joins it to the set's directory, so an
        absolute path or a `..` would make verify, export and training read a file outside the set."""
        if "\x00" in path or "\\" in path:
            raise ValueError(f"{path!r}: must be a relative name inside the shard set (no NUL or backslash)")
        pure = PurePosixPath(path)
        if pure.is_absolute():
            raise ValueError(f"{path!r}: must be a relative name inside the shard set, not an absolute path")
        if ".." in pure.parts:
            raise ValueError(f"{path!r}: must be a relative name inside the shard set (no '..' components)")
        if str(pure) != path or path.endswith("/"):
            raise ValueError(f"{path!r}: must be a normalized relative name (no '.', empty or trailing components)")
        return path


class Manifest(BaseModel):
    """The contract between `ember corpus` (writer) and `midtrain` (reader)."""

    model_config = ConfigDict(extra="allow")
    schema_name: Literal["ShardManifest"] = "ShardManifest"
    schema_version: int = Field(default=MANIFEST_SCHEMA_VERSION, ge=1)
    tokenizer: TokenizerIdentity
    seq_len: int = Field(gt=0)
    dtype: Literal["uint16", "uint32"]
    sources: dict[str, SourceStats]
    padding_tokens: int = Field(ge=0)
    pad_token_id: int = Field(ge=0)
    shards: list[ShardEntry] = Field(min_length=1)
    config_hash: str = Field(min_length=8)
    created_at: str

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        if self.schema_version > MANIFEST_SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is newer than this ember reads "
                f"({MANIFEST_SCHEMA_VERSION}); upgrade ember"
            )
        if self.dtype == "uint16" and self.tokenizer.vocab_size > 65536:
            raise ValueError(f"dtype uint16 cannot hold vocab_size {self.tokenizer.vocab_size}")
        if self.pad_token_id >= self.tokenizer.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside vocab_size {self.tokenizer.vocab_size}")
        repeated = sorted(p for p, n in Counter(s.path for s in self.shards).items() if n > 1)
        if repeated:
            raise ValueError(f"shards list {repeated[:5]} more than once")
        rows = sum(s.rows for s in self.shards)
        sequences = sum(s.sequences for s in self.sources.values())
        if rows != sequences:
            raise ValueError(f"shards hold {rows} rows but sources count {sequences} sequences")
        padding = sum(s.padding_tokens for s in self.sources.values())
        if padding != self.padding_tokens:
            raise ValueError(f"padding_tokens {self.padding_tokens} != sum over sources {padding}")
        return self

    @property
    def num_sequences(self) -> int:
        return sum(s.rows for s in self.shards)


def _issues_from_pydantic(exc: ValidationError) -> list[FieldIssue]:
    return [FieldIssue(".".join(str(p) for p in e["loc"]) or "manifest", e["msg"]) for e in exc.errors()]


def parse_manifest(data: dict, where: str = "manifest") -> Manifest:
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise SchemaValidationError(where, _issues_from_pydantic(exc)) from None


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST_FILENAME
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {directory} is not a finished shard set")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SchemaValidationError(str(path), [FieldIssue("manifest", f"not valid JSON: {exc}")]) from None
    manifest = parse_manifest(data, str(path))
    _check_inside(Path(directory), manifest, str(path))
    return manifest


def _check_inside(directory: Path, manifest: Manifest, where: str) -> None:
    """Every shard resolves (symlinks followed) inside the set: a lexically clean name can still be a
    link out of it, and a reader must never hash, train on or export a file the set does not own."""
    root = directory.resolve()
    issues = [
        FieldIssue(f"shards.{i}.path", f"{entry.path!r} resolves to {target}, outside the shard set {root}")
        for i, entry in enumerate(manifest.shards)
        if not (target := (root / entry.path).resolve()).is_relative_to(root)
    ]
    if issues:
        raise SchemaValidationError(where, issues)


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Atomic: readers see either no manifest or the complete one, never a partial file."""
    return write_atomically(Path(directory) / MANIFEST_FILENAME, manifest.model_dump_json(indent=2).encode("utf-8"))
