"""Corpus rows: `Document` (a normalized input record), `Rejected` (why one was dropped) and
`DuplicateCluster` (who a dedup stage grouped together), and where a corpus build keeps them.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa

from ember.schemas.errors import FieldIssue, raise_if_issues
from ember.schemas.versioning import versioned_schema

DOCUMENT_SCHEMA_VERSION = 3  # 2: metadata.fetch_date, content_type, language_score (web input); 3: quality_score
REJECTED_SCHEMA_VERSION = 1
CLUSTER_SCHEMA_VERSION = 1

DocumentKind = Literal["code", "web"]
DOCUMENT_KINDS: tuple[str, ...] = ("code", "web")

METADATA_TYPE = pa.struct(
    [
        pa.field("url", pa.string()),
        pa.field("repo", pa.string()),
        pa.field("path", pa.string()),
        pa.field("license", pa.string()),
        pa.field("language", pa.string()),
        pa.field("stars", pa.int64()),
        pa.field("fetch_date", pa.string()),  # WARC-Date of a crawled page
        pa.field("content_type", pa.string()),  # its HTTP media type
        pa.field("language_score", pa.float64()),  # language ID's confidence in `language` (web documents)
        pa.field("quality_score", pa.float64()),  # the quality classifier's probability of its label
    ]
)
METADATA_KEYS: tuple[str, ...] = tuple(f.name for f in METADATA_TYPE)
DERIVED_METADATA_KEYS: tuple[str, ...] = ("language_score", "quality_score")
"""Set by the build itself, never mapped from a record field."""

DOCUMENT_SCHEMA = versioned_schema(
    "Document",
    DOCUMENT_SCHEMA_VERSION,
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("text", pa.large_string(), nullable=False),
        pa.field("content_hash", pa.string(), nullable=False),
        pa.field("metadata", METADATA_TYPE),
    ],
)

REJECTED_SCHEMA = versioned_schema(
    "Rejected",
    REJECTED_SCHEMA_VERSION,
    [
        pa.field("document_id", pa.string()),
        pa.field("source", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
    ],
)

CLUSTER_SCHEMA = versioned_schema(
    "DuplicateCluster",
    CLUSTER_SCHEMA_VERSION,
    [
        pa.field("document_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("cluster_id", pa.string(), nullable=False),
        pa.field("kept", pa.bool_(), nullable=False),
    ],
)

# A corpus build's output directory, shared by the job that writes it and the report that reads it back.
CORPUS_TABLES = {"documents": DOCUMENT_SCHEMA, "rejects": REJECTED_SCHEMA, "clusters": CLUSTER_SCHEMA}
STATS_FILE = "stats.json"
REPORT_FILE = "report.md"
REPORT_HTML_FILE = "report.html"


def normalize_for_hash(text: str) -> str:
    """NFC plus stripped trailing whitespace, so cosmetic re-encodings hash equal."""
    return "\n".join(line.rstrip() for line in unicodedata.normalize("NFC", text).strip().splitlines())


def content_hash(text: str) -> str:
    return hashlib.blake2b(normalize_for_hash(text).encode("utf-8"), digest_size=16).hexdigest()


def make_document_id(source: str, text: str) -> str:
    """Deterministic: the same source and content give the same id on every rerun and runner."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(source.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(content_hash(text).encode("ascii"))
    return f"{source}:{digest.hexdigest()}"


@dataclass
class Document:
    source: str
    kind: str
    text: str
    metadata: dict[str, object] = field(default_factory=dict)
    id: str = ""
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not self.content_hash:
            self.content_hash = content_hash(self.text)
        if not self.id:
            self.id = make_document_id(self.source, self.text)

    def issues(self) -> list[FieldIssue]:
        found: list[FieldIssue] = []
        if not self.source:
            found.append(FieldIssue("source", "must be a non-empty source name"))
        if self.kind not in DOCUMENT_KINDS:
            found.append(FieldIssue("kind", f"'{self.kind}' is not one of {', '.join(DOCUMENT_KINDS)}"))
        if not isinstance(self.text, str):
            found.append(FieldIssue("text", f"must be a string, got {type(self.text).__name__}"))
        unknown = sorted(set(self.metadata) - set(METADATA_KEYS))
        if unknown:
            found.append(FieldIssue("metadata", f"unknown keys {unknown}; known: {list(METADATA_KEYS)}"))
        stars = self.metadata.get("stars")
        if stars is not None and not isinstance(stars, int):
            found.append(FieldIssue("metadata.stars", f"must be an integer, got {stars!r}"))
        for key in DERIVED_METADATA_KEYS:
            score = self.metadata.get(key)
            if score is not None and not isinstance(score, (int, float)):
                found.append(FieldIssue(f"metadata.{key}", f"must be a number, got {score!r}"))
        return found

    def validate(self) -> "Document":
        raise_if_issues(f"Document {self.id}", self.issues())
        return self

    def to_row(self) -> dict[str, object]:
        return {
            "id": self.id,
            "source": self.source,
            "kind": self.kind,
            "text": self.text,
            "content_hash": self.content_hash,
            "metadata": {k: self.metadata.get(k) for k in METADATA_KEYS},
        }

    @classmethod
    def from_row(cls, row: dict[str, object]) -> "Document":
        metadata = {k: v for k, v in (row.get("metadata") or {}).items() if v is not None}
        return cls(
            source=row["source"],
            kind=row["kind"],
            text=row["text"],
            metadata=metadata,
            id=row["id"],
            content_hash=row["content_hash"],
        )


@dataclass(frozen=True)
class Rejected:
    source: str
    location: str
    stage: str
    reason: str
    detail: str = ""
    document_id: str | None = None

    def to_row(self) -> dict[str, object]:
        return {
            "document_id": self.document_id,
            "source": self.source,
            "location": self.location,
            "stage": self.stage,
            "reason": self.reason,
            "detail": self.detail,
        }


def reject_row(
    source: str, location: str, stage: str, reason: str, detail: str = "", document_id: str | None = None
) -> dict[str, object]:
    """A `REJECTED_SCHEMA` row: the one way every stage of every pipeline says why a unit was dropped."""
    return Rejected(source, location, stage, reason, detail, document_id).to_row()


def cluster_row(row: dict, stage: str, cluster_id: str, kept: bool) -> dict[str, object]:
    """A `CLUSTER_SCHEMA` row for one member (a corpus row with its `location`) of a duplicate cluster."""
    return {
        "document_id": row["id"],
        "source": row["source"],
        "location": row["location"],
        "stage": stage,
        "cluster_id": cluster_id,
        "kept": kept,
    }


def documents_to_table(documents: list[Document]) -> pa.Table:
    return pa.Table.from_pylist([d.to_row() for d in documents], schema=DOCUMENT_SCHEMA)


def rejected_to_table(rejects: list[Rejected]) -> pa.Table:
    return pa.Table.from_pylist([r.to_row() for r in rejects], schema=REJECTED_SCHEMA)
