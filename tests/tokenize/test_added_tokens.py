"""FIM tokens a Hugging Face tokenizer lacks are added when the config says so: new ids after the vocabulary, a new
identity hash, text that spells them still encodes as text; a tiktoken encoding is refused."""

import pytest

from ember.tokenize.config import TokenizerConfig
from ember.tokenize.tokenizers import TokenizerLoadError, load_tokenizer

FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]


def test_missing_fim_tokens_are_added_with_new_ids_and_identity(hf_tokenizer_path):
    plain = load_tokenizer(TokenizerConfig(path=hf_tokenizer_path, eos_token="<|endoftext|>"))
    with pytest.raises(TokenizerLoadError, match="fim.prefix_token: '<fim_prefix>' is not a token of"):
        plain.special_token_id("fim.prefix_token", "<fim_prefix>")
    added = load_tokenizer(TokenizerConfig(path=hf_tokenizer_path, eos_token="<|endoftext|>",
                                           add_special_tokens=[*FIM_TOKENS, "<|endoftext|>"]))
    ids = [added.special_token_id("fim", t) for t in FIM_TOKENS]
    assert ids == list(range(plain.identity.vocab_size, plain.identity.vocab_size + 3))
    assert added.identity.vocab_size == plain.identity.vocab_size + 3
    assert added.identity.hash != plain.identity.hash and added.identity.file_sha256 == plain.identity.file_sha256
    assert added.eos_id == plain.eos_id  # a token it had keeps its id
    text = "x = '<fim_prefix>' + y"
    assert added.encode_ordinary([text]) == plain.encode_ordinary([text])  # the text is never a FIM sentinel
    again = load_tokenizer(TokenizerConfig(path=hf_tokenizer_path, eos_token="<|endoftext|>", add_special_tokens=FIM_TOKENS))
    assert again.identity.hash == added.identity.hash  # only the tokens actually added count


def test_a_tiktoken_encoding_takes_no_new_tokens():
    with pytest.raises(TokenizerLoadError, match="tokenizer.add_special_tokens: cl100k_base is a tiktoken encoding"):
        load_tokenizer(TokenizerConfig(name="cl100k_base", add_special_tokens=["<fim_prefix>"]))
