from pathlib import Path

import ember.pipelines
import ember.tokenize
from ember.demo.tokenize_stage import DEMO_TOKENIZER
from ember.pipelines.corpus.config import load_config as load_corpus_config
from ember.tokenize.config import load_config
from ember.tokenize.tokenizers import load_tokenizer

EXAMPLE = Path(ember.tokenize.__file__).parent / "examples" / "tokenize.yaml"
CORPUS_EXAMPLE = Path(ember.pipelines.__file__).parent / "examples" / "corpus.yaml"


def test_example_configs_name_the_tokenizer_and_it_loads():
    config = load_config(EXAMPLE)
    assert [s.name for s in config.sources] == ["code", "web"]
    assert "pattern" not in EXAMPLE.read_text() and "special_tokens" not in EXAMPLE.read_text()
    tokenizer = load_tokenizer(config.tokenizer)
    assert (tokenizer.identity.name, tokenizer.eos_token) == ("cl100k_base", "<|endoftext|>")
    assert load_corpus_config(str(CORPUS_EXAMPLE)).tokenize.tokenizer == config.tokenizer
    assert config.tokenizer.model_dump(exclude_defaults=True) == DEMO_TOKENIZER  # the demo builds with the same
