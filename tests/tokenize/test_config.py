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
        (with_(tokenizer={"kind": "tiktoken", "path": "x.tiktoken"}), "tokenizer.path: a .tiktoken file holds only the BPE ranks"),
        (with_(tokenizer={"eos_token": "e"}), "tokenizer.name: set tokenizer.name (a tiktoken encoding such as cl100k_base"),
        (with_(tokenizer={"name": "cl100k_base", "revision": ""}), "tokenizer.revision: String should have at least 1 character"),
        (with_(tokenizer={**VALID["tokenizer"], "dtype": "int8"}), "tokenizer.dtype"),
        (with_(mixture={"budgets": {"cod": 10}}), "mixture.budgets.cod: no source is named 'cod'"),
        (with_(mixture={"seed": 1}), "mixture: set total_tokens, budgets or both"),
        (with_(repositories={"sources": ["webb"]}), "repositories.sources: no source is named 'webb'"),
        (with_(fim={"rate": 1.5}), "fim.rate: Input should be less than or equal to 1"),
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
    ],
)
def test_sizes_that_would_fail_late_are_refused_with_the_bound(changes, named):
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(**changes))
    assert named in str(info.value)


def test_largest_allowed_shard_still_loads():
    config = parse_config(with_(seq_len=2**20, sequences_per_shard=512, rows_per_batch=1024))
    assert config.sequences_per_shard * config.seq_len == 2**29


def test_a_name_leaves_the_path_unset_and_is_kept_as_written(tmp_path):
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(with_(tokenizer={"name": "acme/tiny-coder", "revision": "v1"})))
    tokenizer = load_config(path).tokenizer
    assert (tokenizer.name, tokenizer.path, tokenizer.revision, tokenizer.eos_token) == ("acme/tiny-coder", None, "v1", None)


def test_the_old_pasted_regex_form_says_what_replaces_it():
    old = {"kind": "tiktoken", "path": "cl100k_base.tiktoken", "pattern": r"\S+|\s+", "special_tokens": {"<|endoftext|>": 100257}}
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=old))
    assert str(info.value).splitlines()[1:] == [
        "  tokenizer.pattern: no longer set by hand: the regex comes from the encoding itself; name the encoding "
        "instead (tokenizer.name: cl100k_base)",
        "  tokenizer.special_tokens: no longer set by hand: special tokens and their ids come from the encoding itself; "
        "name the encoding instead (tokenizer.name: cl100k_base)",
    ]
    # The config a manifest recorded before names existed holds them empty: it still loads.
    recorded = {"kind": "huggingface", "path": "t.json", "name": None, "pattern": None, "special_tokens": {}, "eos_token": "e"}
    assert parse_config(with_(tokenizer=recorded)).tokenizer.path.name == "t.json"


def test_every_problem_of_the_tokenizer_section_is_listed():
    tokenizer = {"kind": "tiktoken", "path": "t.tiktoken", "revision": "v1"}
    with pytest.raises(TokenizeConfigError) as info:
        parse_config(with_(tokenizer=tokenizer))
    lines = str(info.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["tokenizer.path", "tokenizer.revision"]
