"""Arrow table layouts, validation messages and additive schema evolution."""

import io

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import given, settings

from ember.schemas import (
    DOCUMENT_SCHEMA,
    ROLLOUT_SCHEMA,
    Document,
    SchemaValidationError,
    conform,
    make_document_id,
)
from ember.schemas.documents import Rejected, documents_to_table, rejected_to_table
from ember.schemas.rollouts import Reward, rewards_to_table, rollouts_to_table, table_to_rollouts
from ember.schemas.versioning import schema_identity, versioned_schema
from tests.schemas.strategies import assert_same, rollouts


@settings(deadline=None)  # the first example pays Arrow's warm-up, over 200 ms on a loaded machine
@given(rollouts())
def test_rollout_table_round_trip(rollout):
    [back] = table_to_rollouts(rollouts_to_table([rollout]))
    assert_same(back, rollout)


def test_tables_carry_schema_name_and_version():
    table = documents_to_table([Document("stack", "code", "print(1)")])
    assert schema_identity(table.schema) == ("Document", 3)
    assert table.schema.equals(DOCUMENT_SCHEMA, check_metadata=True)


def test_document_id_is_deterministic_and_source_scoped():
    assert make_document_id("a", "x = 1\n") == make_document_id("a", "x = 1")
    assert make_document_id("a", "x = 1") != make_document_id("b", "x = 1")
    assert Document("a", "code", "x").id == Document("a", "code", "x").id


def test_document_validation_names_every_bad_field():
    doc = Document("", "binary", "t", metadata={"stars": "many", "colour": "red"})
    with pytest.raises(SchemaValidationError) as info:
        doc.validate()
    fields = {issue.field for issue in info.value.issues}
    assert fields == {"source", "kind", "metadata", "metadata.stars"}
    assert "'binary' is not one of code, web" in str(info.value)


def test_rejected_rows_keep_location_and_reason():
    table = rejected_to_table([Rejected("web", "crawl.jsonl:17", "read", "invalid_json", "Expecting value")])
    assert table.to_pylist()[0]["location"] == "crawl.jsonl:17"


def test_rollout_validation_names_the_field():
    from ember.rollouts.simulate import synthetic_rollout

    rollout = synthetic_rollout(np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=16, layers=2)
    rollout.sampler_logprobs = rollout.sampler_logprobs.astype(np.float64)
    rollout.routed_experts = rollout.routed_experts[:3]
    with pytest.raises(SchemaValidationError) as info:
        rollout.validate()
    assert {i.field for i in info.value.issues} == {"sampler_logprobs", "routed_experts"}


def test_reward_validation_rejects_non_finite():
    with pytest.raises(SchemaValidationError, match="components.judge"):
        Reward("r", "g", "judge", 1.0, 0, {"judge": float("nan")}).validate()


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def test_old_data_without_a_new_optional_field_stays_readable():
    """Version-1 files written before an optional column existed read under the version-2 schema."""
    v1 = versioned_schema("Sample", 1, [pa.field("id", pa.string(), nullable=False)])
    v2 = versioned_schema(
        "Sample", 2, [pa.field("id", pa.string(), nullable=False), pa.field("judge", pa.string())]
    )
    old = ipc.open_file(pa.BufferReader(_ipc_bytes(pa.table({"id": ["a", "b"]}, schema=v1)))).read_all()
    read = conform(old, v2)
    assert read.column("judge").to_pylist() == [None, None]
    assert read.column("id").to_pylist() == ["a", "b"]


def test_version_1_documents_read_with_the_web_metadata_fields_empty():
    """Document v2 added metadata.fetch_date, content_type and language_score (web input); v1 files conform."""
    v1_metadata = pa.struct([f for f in DOCUMENT_SCHEMA.field("metadata").type if f.name in
                             ("url", "repo", "path", "license", "language", "stars")])
    v1 = versioned_schema("Document", 1, [*(f for f in DOCUMENT_SCHEMA if f.name != "metadata"),
                                          pa.field("metadata", v1_metadata)])
    row = {"id": "s:1", "source": "s", "kind": "web", "text": "t", "content_hash": "h",
           "metadata": {"url": "https://example.org/", "repo": None, "path": None, "license": None,
                        "language": "en", "stars": None}}
    read = conform(pa.Table.from_pylist([row], schema=v1), DOCUMENT_SCHEMA)
    metadata = read.column("metadata").to_pylist()[0]
    assert metadata["url"] == "https://example.org/" and metadata["language"] == "en"
    assert (metadata["fetch_date"], metadata["content_type"], metadata["language_score"]) == (None, None, None)


def test_new_data_with_extra_columns_reads_in_an_old_reader():
    from ember.rollouts.simulate import synthetic_rollout

    rollout = synthetic_rollout(np.random.default_rng(1), group_id="g", prompt_id="p", num_tokens=8, layers=None)
    table = rollouts_to_table([rollout]).append_column("judge_notes", pa.array(["fine"]))
    [back] = table_to_rollouts(table)
    assert_same(back, rollout)


def test_missing_required_column_is_named():
    table = rollouts_to_table([]).drop_columns(["tokens"])
    with pytest.raises(SchemaValidationError, match="field 'tokens': required column is missing"):
        conform(table, ROLLOUT_SCHEMA)


def test_newer_schema_version_is_refused():
    newer = ROLLOUT_SCHEMA.with_metadata({b"ember.schema": b"Rollout", b"ember.schema_version": b"99"})
    with pytest.raises(SchemaValidationError, match="upgrade ember"):
        conform(pa.Table.from_pylist([], schema=newer), ROLLOUT_SCHEMA)


def test_rewards_table_keeps_components():
    table = rewards_to_table([Reward("r", "g", "tests", 0.5, 10, {"passed": 1.0})])
    assert table.to_pylist()[0]["components"] == [("passed", 1.0)]
