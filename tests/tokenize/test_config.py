import pytest

from ember.configs import TokenizeConfigError
from ember.tokenize.config import load_config, parse_config

VALID = {
    "output_dir": "out",
    "tokenizer": {"kind": "huggingface", "path": "tokenizer.json", "eos_token": "<|endoftext|>"},
    "sources": [{"name": "code", "path": "code/*.parquet", "weight": 0.7}, {"name": "web", "path": "web/*.parquet"}],
}


def with_(**changes):
    return {**VALID, **changes}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (with_(seq_lenn=4096), "seq_lenn: unknown key"),
        (with_(seq_len=1), "seq_len: Input should be greater than or equal to 2"),
        (with_(packing="first_fit"), "packing: Input should be 'best_fit' or 'concat_chunk'"),
        (with_(sources=[{"name": "code", "path": "a", "weight": -1}]), "sources.0.weight"),
        (with_(sources=[{"name": "c", "path": "a"}, {"name": "c", "path": "b"}]), "repeated: ['c']"),
        (with_(tokenizer={"kind": "tiktoken", "path": "x.tiktoken", "eos_token": "e"}), "pattern is required"),
        (with_(tokenizer={"kind": "huggingface", "path": "t.json"}), "set pad_token"),
        (with_(tokenizer={**VALID["tokenizer"], "dtype": "int8"}), "tokenizer.dtype"),
    ],
)
def test_bad_keys_are_named(data, named):
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(data)
    assert named in str(info.value)


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    import yaml

    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(VALID))
    config = load_config(path)
    assert config.output_dir == tmp_path / "out"
    assert config.tokenizer.path == tmp_path / "tokenizer.json"
    assert config.sources[0].path == str(tmp_path / "code/*.parquet")


def test_config_hash_ignores_the_output_dir_but_not_packing():
    base = parse_config(VALID).config_hash("t" * 16)
    assert parse_config(with_(output_dir="elsewhere")).config_hash("t" * 16) == base
    assert parse_config(with_(seq_len=4096)).config_hash("t" * 16) != base
    assert parse_config(VALID).config_hash("u" * 16) != base


def test_unreadable_config_files(tmp_path):
    with pytest.raises(TokenizeConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(TokenizeConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")
