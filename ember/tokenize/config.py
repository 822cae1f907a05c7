"""Typed configuration of `ember corpus tokenize`: tokenizer, sources, packing and shards.

Every model forbids unknown keys so a typo fails loudly; `load_config` turns pydantic's errors into
one `TokenizeConfigError` whose lines name the bad key by its dotted path (`sources.1.weight: ...`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ember import configs
from ember.configs import StrictModel, TokenizeConfigError, at_most

MAX_SEQ_LEN = 2**20
SEQ_LEN_WHY = "1M tokens, beyond any model's context"
MAX_SHARD_BYTES = 8 * 2**30
"""A shard is assembled in one worker's memory: its pieces, the assembled rows and the encoded file."""


TIKTOKEN_SPECIAL_TOKENS: dict[str, dict[str, int]] = {
    "cl100k_base": {
        "<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    "p50k_base": {"<|endoftext|>": 50256},
    "r50k_base": {"<|endoftext|>": 50256},
    "gpt2": {"<|endoftext|>": 50256},
}
"""The special tokens of tiktoken's published encodings (tiktoken_ext.openai_public), keyed by the BPE file's
stem: a .tiktoken file holds only the ordinary ranks, so a config that names one of these tokens without its
`special_tokens` entry is told the exact line to add."""

FRAMING_TOKENS = ("bos_token", "eos_token", "pad_token")


class TokenizerConfig(StrictModel):
    """Which local tokenizer file to load and how documents are framed with BOS/EOS."""

    kind: Literal["huggingface", "tiktoken"]
    path: Path = Field(description="tokenizer.json (huggingface) or a .tiktoken BPE ranks file")
    name: str | None = Field(default=None, min_length=1, description="defaults to the file's stem")
    pattern: str | None = Field(default=None, description="tiktoken only: the pre-tokenizer regex")
    special_tokens: dict[str, Annotated[int, Field(ge=0, lt=2**32)]] = Field(
        default_factory=dict, description="tiktoken only: name -> id (token ids are stored as uint32)"
    )
    bos_token: str | None = Field(default=None, description="prepended to every document when set")
    eos_token: str | None = Field(default=None, description="appended to every document when set")
    pad_token: str | None = Field(default=None, description="fills the tail of a sequence; defaults to eos_token")
    dtype: Literal["auto", "uint16", "uint32"] = "auto"

    @model_validator(mode="after")
    def _kind_specific(self) -> "TokenizerConfig":
        problems = []
        if self.kind == "tiktoken" and not self.pattern:
            problems.append(("pattern", "required for kind 'tiktoken' (the BPE file holds only the ranks)"))
        if self.kind == "huggingface":
            problems += [
                (key, "applies to kind 'tiktoken' only; tokenizer.json holds its own")
                for key in ("pattern", "special_tokens")
                if getattr(self, key)
            ]
        if self.pad_token is None and self.eos_token is None:
            problems.append(("pad_token", "set pad_token (or eos_token, which padding then reuses)"))
        if self.kind == "tiktoken":
            problems += self._missing_special_tokens()
        configs.check(problems)
        return self

    def _missing_special_tokens(self) -> list[tuple[str, str]]:
        """Framing tokens without a `special_tokens` entry: one problem that shows the YAML lines adding them."""
        missing = {key: getattr(self, key) for key in FRAMING_TOKENS if getattr(self, key) not in (None, *self.special_tokens)}
        if not missing:
            return []
        published = next((n for n in (self.path.stem, self.name) if n in TIKTOKEN_SPECIAL_TOKENS), None)
        known = TIKTOKEN_SPECIAL_TOKENS.get(published or "", {})
        entries = [
            f"{json.dumps(token)}: {known[token]}   # {published}'s id" if token in known
            else f"{json.dumps(token)}: ID   # ID: the id the model was trained with"
            for token in dict.fromkeys(missing.values())  # eos and pad may name the same token
        ]
        if self.special_tokens:
            where, block = "add to it", entries
        else:
            where, block = "add under tokenizer", ["special_tokens:", *(f"  {entry}" for entry in entries)]
        named = " and ".join(f"{key} {token!r}" for key, token in missing.items())
        return [(
            "special_tokens",
            f"{named} {'is' if len(missing) == 1 else 'are'} missing from this mapping (a .tiktoken file holds only "
            f"the ordinary tokens; special tokens and their ids are listed here); {where}:"
            + "".join(f"\n      {line}" for line in block),
        )]


class ShardSource(StrictModel):
    """One deduplicated Parquet input of `Document` rows and its share of the mixture."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    path: str = Field(min_length=1, description="file or glob of Parquet files with DOCUMENT_SCHEMA rows")
    weight: float = Field(default=1.0, ge=0)


class PackSettings(StrictModel):
    """How documents become shards: everything but where they come from and where shards go.

    `ember corpus tokenize` takes these with its own `sources` and `output_dir`; `ember corpus build`
    takes them under its `tokenize:` key and feeds them the documents it kept.
    """

    tokenizer: TokenizerConfig
    seq_len: Annotated[int, at_most(MAX_SEQ_LEN, SEQ_LEN_WHY)] = Field(default=8192, ge=2)
    packing: Literal["best_fit", "concat_chunk"] = "best_fit"
    window_documents: Annotated[int, at_most(10_000_000, "a window's document ids and lengths are packed in one worker's memory")] = Field(
        default=50_000, ge=1, description="documents per packing window (lengths only are held per window)"
    )
    sequences_per_shard: Annotated[int, at_most(1_048_576, "a shard is assembled in one worker's memory")] = Field(
        default=1024, ge=1
    )
    rows_per_batch: Annotated[int, at_most(65_536, "a record batch is what a reader decompresses for one row")] = Field(
        default=16, ge=1, description="rows per zstd record batch (random-access unit)"
    )
    encode_batch_documents: Annotated[int, at_most(65_536, "one tokenizer call holds all of them and their tokens")] = Field(
        default=2048, ge=1, description="documents per tokenizer batch call"
    )
    seed: int = Field(default=0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _shards_fit(self) -> "PackSettings":
        problems = []
        if self.rows_per_batch * self.seq_len >= 2**31:
            problems.append(
                f"rows_per_batch x seq_len = {self.rows_per_batch * self.seq_len:,} tokens in one record batch; "
                "Arrow's 32-bit list offsets hold fewer than 2^31 (lower rows_per_batch)"
            )
        need = 3 * 4 * self.sequences_per_shard * self.seq_len
        if need > MAX_SHARD_BYTES:
            problems.append(
                f"sequences_per_shard x seq_len = {self.sequences_per_shard * self.seq_len:,} tokens per shard need about "
                f"{configs.gib(need)} in one worker (three copies of 4-byte tokens); at most {configs.gib(MAX_SHARD_BYTES)} "
                "(lower sequences_per_shard)"
            )
        configs.check(problems)
        return self


class TokenizeConfig(PackSettings):
    """The whole build: one config hash covers everything that changes the bytes of the shards."""

    output_dir: Path
    sources: list[ShardSource] = Field(min_length=1)

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, sources: list[ShardSource]) -> list[ShardSource]:
        return configs.unique_names(sources)

    def config_hash(self, tokenizer_hash: str) -> str:
        """Hash of what determines the output bytes; the output directory itself is left out."""
        payload = self.model_dump(mode="json", exclude={"output_dir"})
        payload["tokenizer"]["path"] = None
        payload["tokenizer_hash"] = tokenizer_hash
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def parse_config(data: object, where: str = "config") -> TokenizeConfig:
    return configs.validate(TokenizeConfig, data, where, TokenizeConfigError)


def load_config(path: str | Path) -> TokenizeConfig:
    """Relative paths inside the file resolve against the file's own directory."""
    path = Path(path)
    data = configs.read_yaml_mapping(path, TokenizeConfigError)
    config = parse_config(data, str(path))
    base = path.resolve().parent
    return config.model_copy(
        update={
            "output_dir": base / config.output_dir,
            "tokenizer": config.tokenizer.model_copy(update={"path": base / config.tokenizer.path}),
            "sources": [s.model_copy(update={"path": str(base / s.path)}) for s in config.sources],
        }
    )
