"""Tokenizers loaded from local files only: a Hugging Face `tokenizer.json` or a tiktoken BPE file.

Text is always encoded as ordinary text: a special-token look-alike such as "<|endoftext|>" inside a
document becomes the ordinary tokens of those characters, never the special id (otherwise any web
page quoting it would inject a document boundary). BOS/EOS are added by the configured policy only.
The identity (name + hash of the files and of the settings that change the ids) goes into the
manifest so a trainer can refuse shards built with another tokenizer.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ember.schemas.shards import Manifest, TokenizerIdentity
from ember.tokenize.config import TokenizerConfig

DTYPE_LIMITS = {"uint16": 1 << 16, "uint32": 1 << 32}


class TokenizerLoadError(ValueError):
    """The tokenizer file is missing, unreadable, or does not parse as the configured kind."""


class TokenizerMismatchError(ValueError):
    """A shard set was built with a different tokenizer than the one configured for training."""


class _Backend(Protocol):
    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]: ...

    def special_id(self, token: str) -> int | None: ...

    def special_tokens(self) -> list[str]: ...

    @property
    def vocab_size(self) -> int: ...


class _HuggingFaceBackend:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerLoadError(f"{path}: not a loadable Hugging Face tokenizer.json ({exc})") from None
        # Not persisted in tokenizer.json: without it "<|endoftext|>" in text becomes the special id.
        self._tokenizer.encode_special_tokens = True

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch, not encode_batch_fast: the same ids, and measured 15-20% faster single-threaded
        # with tokenizers 0.23 (bench/bench_tokenize_pack.py).
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def special_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def special_tokens(self) -> list[str]:
        return [t.content for _, t in sorted(self._tokenizer.get_added_tokens_decoder().items()) if t.special]

    @property
    def vocab_size(self) -> int:
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def parse_tiktoken_ranks(data: bytes, where: str) -> dict[bytes, int]:
    """The .tiktoken format: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerLoadError(
                f"{where}: line {number} is not '<base64 token> <rank>'; not a tiktoken BPE file"
            ) from None
    if not ranks:
        raise TokenizerLoadError(f"{where}: holds no BPE ranks")
    return ranks


class _TiktokenBackend:
    def __init__(self, path: Path, data: bytes, pattern: str, special_tokens: dict[str, int]):
        import tiktoken

        ranks = parse_tiktoken_ranks(data, str(path))
        try:
            self._encoding = tiktoken.Encoding(
                path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens
            )
        except Exception as exc:  # bad regex or overlapping ids surface from the Rust core
            raise TokenizerLoadError(f"{path}: tiktoken rejected the ranks/pattern/special tokens ({exc})") from None
        self._special = dict(special_tokens)

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts, num_threads=1)

    def special_id(self, token: str) -> int | None:
        return self._special.get(token)

    def special_tokens(self) -> list[str]:
        return list(self._special)

    @property
    def vocab_size(self) -> int:
        return self._encoding.max_token_value + 1


@dataclass(frozen=True)
class EncodedBatch:
    """One tokenizer call's output: per-document token arrays, BOS/EOS already applied."""

    tokens: list[np.ndarray]
    content_lengths: list[int]  # tokens from the text itself; 0 means empty after tokenization


class Tokenizer:
    """A loaded tokenizer plus the document framing policy; build with `load_tokenizer`."""

    def __init__(self, config: TokenizerConfig, backend: _Backend, identity: TokenizerIdentity):
        self.config = config
        self.identity = identity
        self._backend = backend
        self.bos_id = self._special("bos_token", config.bos_token)
        self.eos_id = self._special("eos_token", config.eos_token)
        self.pad_id = self._special("pad_token", config.pad_token) if config.pad_token else self.eos_id
        self.dtype = resolve_dtype(config.dtype, identity.vocab_size)

    def _special(self, key: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.special_id(token)
        if token_id is None:
            raise TokenizerLoadError(f"tokenizer.{key}: '{token}' is not a token of {self.identity.name}; {self._choices(token, key)}")
        return token_id

    def _choices(self, token: str, key: str) -> str:
        """What `key` can name instead: the closest of the tokenizer's special tokens, and all of them."""
        special = self._backend.special_tokens()
        if not special:
            return f"{self.config.path} defines no special tokens"
        closest = difflib.get_close_matches(token, special, n=1, cutoff=0.6)
        guess = f"did you mean '{closest[0]}'? " if closest else ""
        shown = ", ".join(repr(t) for t in special[:20]) + (f" and {len(special) - 20} more" if len(special) > 20 else "")
        return f"{guess}set tokenizer.{key} to one of the special tokens {self.config.path} defines: {shown}"

    def encode_ordinary(self, texts: list[str]) -> list[list[int]]:
        """The library's own ids for the text, no framing."""
        return self._backend.encode_ordinary_batch(texts)

    def encode_batch(self, texts: list[str]) -> EncodedBatch:
        ids = self._backend.encode_ordinary_batch(texts)
        prefix = [self.bos_id] if self.bos_id is not None else []
        suffix = [self.eos_id] if self.eos_id is not None else []
        if prefix or suffix:
            arrays = [np.array(prefix + row + suffix, dtype=np.uint32) for row in ids]
        else:
            arrays = [np.array(row, dtype=np.uint32) for row in ids]
        return EncodedBatch(arrays, [len(row) for row in ids])


def resolve_dtype(requested: str, vocab_size: int) -> str:
    """The narrowest dtype that holds every id; a requested dtype that is too narrow is an error."""
    if requested == "auto":
        return "uint16" if vocab_size <= DTYPE_LIMITS["uint16"] else "uint32"
    if vocab_size > DTYPE_LIMITS[requested]:
        raise TokenizerLoadError(
            f"tokenizer.dtype: {requested} holds ids below {DTYPE_LIMITS[requested]}, but the vocabulary "
            f"has {vocab_size} ids; use uint32 or auto"
        )
    return requested


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(f"tokenizer.path: cannot read {path} ({exc.strerror})") from None


def load_tokenizer(config: TokenizerConfig) -> Tokenizer:
    path = Path(config.path)
    data = _read(path)
    digest = hashlib.sha256(data)
    if config.kind == "huggingface":
        backend: _Backend = _HuggingFaceBackend(path)
    else:
        backend = _TiktokenBackend(path, data, config.pattern or "", config.special_tokens)
        # pattern and special tokens change the ids as much as the ranks do
        digest.update(json.dumps([config.pattern, sorted(config.special_tokens.items())]).encode())
    identity = TokenizerIdentity(
        name=config.name or path.stem, hash=digest.hexdigest()[:32], vocab_size=backend.vocab_size
    )
    return Tokenizer(config, backend, identity)


def check_tokenizer_matches(manifest: Manifest, identity: TokenizerIdentity) -> None:
    """A trainer configured with one tokenizer must not read shards built with another."""
    if manifest.tokenizer.hash != identity.hash or manifest.tokenizer.vocab_size != identity.vocab_size:
        raise TokenizerMismatchError(
            f"shard set was built with tokenizer {manifest.tokenizer.name} (hash {manifest.tokenizer.hash}, "
            f"vocab {manifest.tokenizer.vocab_size}) but the configured tokenizer is {identity.name} "
            f"(hash {identity.hash}, vocab {identity.vocab_size})"
        )
