"""Validation errors that name the record, the field and what is wrong with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldIssue:
    field: str
    problem: str

    def __str__(self) -> str:
        return f"field '{self.field}': {self.problem}"


class SchemaValidationError(ValueError):
    """Raised when a record breaks its schema; carries every issue found, not just the first."""

    def __init__(self, record: str, issues: list[FieldIssue]):
        self.record = record
        self.issues = list(issues)
        super().__init__(f"{record} is invalid: " + "; ".join(str(i) for i in self.issues))


class DecodeError(ValueError):
    """The one exception the wire codec raises for bytes it cannot decode."""


class InvalidRecord(DecodeError):
    """Well-formed bytes whose record breaks its schema (a non-finite log-prob, an empty id, ...)."""


def raise_if_issues(record: str, issues: list[FieldIssue]) -> None:
    if issues:
        raise SchemaValidationError(record, issues)
