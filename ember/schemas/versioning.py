"""Schema identity and additive evolution for Arrow tables.

Every ember table carries its schema name and version in the Arrow schema metadata. Readers accept
older data as long as only optional (nullable) fields were added since: missing optional columns are
filled with nulls, unknown extra columns are kept, a missing required column is an error naming it.
"""

from __future__ import annotations

import pyarrow as pa

from ember.schemas.errors import FieldIssue, SchemaValidationError

SCHEMA_NAME_KEY = b"ember.schema"
SCHEMA_VERSION_KEY = b"ember.schema_version"


def versioned_schema(name: str, version: int, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={SCHEMA_NAME_KEY: name.encode(), SCHEMA_VERSION_KEY: str(version).encode()},
    )


def schema_identity(schema: pa.Schema) -> tuple[str | None, int | None]:
    meta = schema.metadata or {}
    name = meta.get(SCHEMA_NAME_KEY)
    version = meta.get(SCHEMA_VERSION_KEY)
    return (name.decode() if name else None, int(version) if version else None)


def conform(table: pa.Table, target: pa.Schema) -> pa.Table:
    """Return `table` laid out as `target`: the reader side of additive schema evolution."""
    target_name, target_version = schema_identity(target)
    name, version = schema_identity(table.schema)
    issues: list[FieldIssue] = []
    if name is not None and name != target_name:
        issues.append(FieldIssue("schema", f"table holds '{name}' rows, expected '{target_name}'"))
    if version is not None and target_version is not None and version > target_version:
        issues.append(
            FieldIssue(
                "schema_version",
                f"data is version {version}, this ember reads up to {target_version}; upgrade ember",
            )
        )
    columns: list[pa.ChunkedArray] = []
    for field in target:
        if field.name in table.column_names:
            column = table.column(field.name)
            if column.type != field.type:
                try:
                    column = column.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    issues.append(
                        FieldIssue(field.name, f"type {column.type} cannot be read as {field.type}: {exc}")
                    )
                    continue
            columns.append(column)
        elif field.nullable:
            columns.append(pa.chunked_array([pa.nulls(table.num_rows, field.type)], field.type))
        else:
            issues.append(FieldIssue(field.name, "required column is missing"))
    if issues:
        raise SchemaValidationError(f"table '{target_name}'", issues)
    extras = [n for n in table.column_names if n not in target.names]
    fields = list(target) + [table.schema.field(n) for n in extras]
    columns += [table.column(n) for n in extras]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=target.metadata))
