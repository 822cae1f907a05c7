import re

import pytest
import yaml

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
        (with_(tokenizer={"kind": "tiktoken", "path": "x.tiktoken", "eos_token": "e"}), "tokenizer.pattern: required for kind 'tiktoken'"),
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


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"seq_len": 2**21}, "seq_len: at most 1,048,576"),
        ({"sequences_per_shard": 2**21}, "sequences_per_shard: at most 1,048,576"),
        ({"rows_per_batch": 10**6}, "rows_per_batch: at most 65,536"),
        ({"encode_batch_documents": 10**6}, "encode_batch_documents: at most 65,536"),
        ({"window_documents": 10**9}, "window_documents: at most 10,000,000"),
        ({"seq_len": 2**20, "rows_per_batch": 2048}, "Arrow's 32-bit list offsets hold fewer than 2^31"),
        ({"seq_len": 2**20, "sequences_per_shard": 4096}, "tokens per shard need about 48.0 GiB in one worker"),
        ({"tokenizer": {"kind": "tiktoken", "path": "x", "pattern": "p", "eos_token": "e", "special_tokens": {"e": 2**32}}},
         "tokenizer.special_tokens.e: Input should be less than 4294967296"),
    ],
)
def test_sizes_that_would_fail_late_are_refused_with_the_bound(changes, named):
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(**changes))
    assert named in str(info.value)


def test_largest_allowed_shard_still_loads():
    config = parse_config(with_(seq_len=2**20, sequences_per_shard=512, rows_per_batch=1024))
    assert config.sequences_per_shard * config.seq_len == 2**29


CL100K = {"kind": "tiktoken", "path": "cl100k_base.tiktoken", "pattern": r"\S+|\s+", "eos_token": "<|endoftext|>"}


def _suggestion(message: str) -> dict:
    """The YAML block the special-token error tells the user to add, parsed."""
    block = message.split("add under tokenizer:\n", 1)[1] if "add under tokenizer:" in message else message.split("add to it:\n", 1)[1]
    return yaml.safe_load(block)


def test_an_eos_token_missing_from_special_tokens_says_which_yaml_line_adds_it():
    # Was: "eos_token '<|endoftext|>' is not a token of cl100k_base", at tokenizer load, after the other errors.
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=CL100K))
    message = str(info.value)
    assert "tokenizer.special_tokens: eos_token '<|endoftext|>' is missing from this mapping" in message
    assert '\n      special_tokens:\n        "<|endoftext|>": 100257   # cl100k_base\'s id' in message
    fixed = {**CL100K, **_suggestion(message)}
    assert parse_config(with_(tokenizer=fixed)).tokenizer.special_tokens == {"<|endoftext|>": 100257}


def test_a_partial_special_tokens_mapping_gets_the_missing_entries_only():
    tokenizer = {**CL100K, "bos_token": "<|fim_prefix|>", "special_tokens": {"<|fim_prefix|>": 100258}}
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=tokenizer))
    message = str(info.value)
    assert "eos_token '<|endoftext|>' is missing from this mapping" in message and "bos_token" not in message
    assert _suggestion(message) == {"<|endoftext|>": 100257}


def test_a_token_of_an_unknown_encoding_gets_a_placeholder_id_and_every_framing_token_is_named():
    tokenizer = {**CL100K, "path": "mine.tiktoken", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=tokenizer))
    message = str(info.value)
    assert "bos_token '<s>' and eos_token '</s>' and pad_token '</s>' are missing from this mapping" in message
    assert re.findall(r'^ +"(.*)": (\w+)', message, re.M) == [("<s>", "ID"), ("</s>", "ID")]  # pad reuses eos's line


def test_every_problem_of_the_tokenizer_section_is_listed():
    tokenizer = {"kind": "huggingface", "path": "t.json", "pattern": "x", "special_tokens": {"a": 1}}
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=tokenizer))
    lines = str(info.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["tokenizer.pattern", "tokenizer.special_tokens", "tokenizer.pad_token"]
