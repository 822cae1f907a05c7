import json

import numpy as np
import pytest

from ember.schemas import Manifest, SchemaValidationError, read_manifest, write_manifest
from ember.schemas.shards import MANIFEST_FILENAME, packed_sequence_issues


def manifest_data(**overrides) -> dict:
    data = {
        "tokenizer": {"name": "cl100k_base", "hash": "ab" * 16, "vocab_size": 100277},
        "seq_len": 8,
        "dtype": "uint32",
        "sources": {"code": {"documents": 3, "tokens": 14, "sequences": 2, "padding_tokens": 2}},
        "padding_tokens": 2,
        "pad_token_id": 0,
        "shards": [{"path": "shard-00000.arrow", "rows": 2, "bytes": 100, "sha256": "0" * 64}],
        "config_hash": "deadbeefcafe",
        "created_at": "2026-12-02T00:00:00Z",
    }
    data.update(overrides)
    return data


def test_manifest_write_is_atomic_and_reads_back(tmp_path):
    manifest = Manifest.model_validate(manifest_data())
    write_manifest(tmp_path, manifest)
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_FILENAME]
    assert read_manifest(tmp_path) == manifest


def test_directory_without_manifest_is_not_a_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished shard set"):
        read_manifest(tmp_path)


def test_manifest_errors_name_the_key(tmp_path):
    (tmp_path / MANIFEST_FILENAME).write_text(json.dumps(manifest_data(seq_len=0, dtype="int8")))
    with pytest.raises(SchemaValidationError) as info:
        read_manifest(tmp_path)
    assert {i.field for i in info.value.issues} == {"seq_len", "dtype"}


def test_manifest_counts_must_agree():
    with pytest.raises(SchemaValidationError, match="shards hold 2 rows but sources count 5"):
        from ember.schemas.shards import parse_manifest

        bad = manifest_data()
        bad["sources"]["code"]["sequences"] = 5
        parse_manifest(bad)


def test_uint16_cannot_hold_a_large_vocab():
    from ember.schemas.shards import parse_manifest

    with pytest.raises(SchemaValidationError, match="uint16 cannot hold"):
        parse_manifest(manifest_data(dtype="uint16"))


def test_manifest_accepts_unknown_keys_from_newer_writers():
    from ember.schemas.shards import parse_manifest

    assert parse_manifest(manifest_data(mixture_seed=7)).seq_len == 8


def test_packed_sequence_invariants():
    tokens = np.zeros(8, np.uint32)
    segments = [
        {"document_id": "a", "doc_token_start": 0, "doc_token_end": 5},
        {"document_id": "b", "doc_token_start": 10, "doc_token_end": 12},
    ]
    assert packed_sequence_issues(tokens, np.array([0, 5, 7]), segments, 8) == []
    issues = packed_sequence_issues(tokens, np.array([0, 5, 6]), segments, 8)
    assert [i.field for i in issues] == ["segments[1]"]
    assert packed_sequence_issues(tokens[:7], np.array([0, 9]), segments[:1], 8)[0].field == "tokens"


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../other/shard.arrow", "no '..' components"),
        ("sub/../../shard.arrow", "no '..' components"),
        ("/data/other/shard.arrow", "not an absolute path"),
        ("./shard.arrow", "normalized relative name"),
        ("sub//shard.arrow", "normalized relative name"),
        ("sub/", "normalized relative name"),
        ("..\\shard.arrow", "no NUL or backslash"),
    ],
)
def test_shard_paths_must_be_relative_names_inside_the_set(path, reason):
    from ember.schemas.shards import parse_manifest

    bad = manifest_data()
    bad["shards"][0]["path"] = path
    with pytest.raises(SchemaValidationError) as info:
        parse_manifest(bad)
    assert [i.field for i in info.value.issues] == ["shards.0.path"]
    assert reason in str(info.value) and repr(path) in str(info.value)


def test_a_shard_in_a_subdirectory_is_inside_the_set():
    from ember.schemas.shards import parse_manifest

    good = manifest_data()
    good["shards"][0]["path"] = "part-1/shard-00000.arrow"
    assert parse_manifest(good).shards[0].path == "part-1/shard-00000.arrow"


def test_a_symlink_out_of_the_set_is_refused_when_the_manifest_is_read(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "secret.arrow").write_bytes(b"x" * 100)
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "shard-00000.arrow").symlink_to(tmp_path / "other" / "secret.arrow")
    (tmp_path / "set" / MANIFEST_FILENAME).write_text(json.dumps(manifest_data()))
    with pytest.raises(SchemaValidationError, match="resolves to .*secret.arrow, outside the shard set") as info:
        read_manifest(tmp_path / "set")
    assert [i.field for i in info.value.issues] == ["shards.0.path"]
    (tmp_path / "set" / "shard-00000.arrow").unlink()  # a link that stays inside the set is fine
    (tmp_path / "set" / "real.arrow").write_bytes(b"x" * 100)
    (tmp_path / "set" / "shard-00000.arrow").symlink_to("real.arrow")
    assert read_manifest(tmp_path / "set").shards[0].path == "shard-00000.arrow"


def test_a_shard_listed_twice_and_a_pad_id_outside_the_vocabulary_are_refused():
    from ember.schemas.shards import parse_manifest

    twice = manifest_data()
    twice["shards"] = [{**twice["shards"][0], "rows": 1}, {**twice["shards"][0], "rows": 1}]
    with pytest.raises(SchemaValidationError, match=r"shards list \['shard-00000.arrow'\] more than once"):
        parse_manifest(twice)
    with pytest.raises(SchemaValidationError, match="pad_token_id 100277 is outside vocab_size 100277"):
        parse_manifest(manifest_data(pad_token_id=100277))
