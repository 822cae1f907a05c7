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
from ember.files import is_url

MAX_SEQ_LEN = 2**20
SEQ_LEN_WHY = "1M tokens, beyond any model's context"
MAX_SHARD_BYTES = 8 * 2**30
"""A shard is assembled in one worker's memory: its pieces, the assembled rows and the encoded file."""


LEGACY_KEYS = {
    "pattern": "the regex comes from the encoding itself",
    "special_tokens": "special tokens and their ids come from the encoding itself",
}
"""Keys of the old hand-pasted tiktoken form; a config still holding them is told what replaces them."""


class TokenizerConfig(StrictModel):
    """Which tokenizer - by name or by file - and how documents are framed with BOS/EOS.

    A name is looked up offline (ember/tokenize/tokenizers.py): a tiktoken encoding whose BPE file ships
    in an installed package (cl100k_base), else a Hugging Face repo id in the local Hugging Face cache.
    Regexes and special-token ids are never written here: they come from the encoding.
    """

    name: str | None = Field(
        default=None, min_length=1,
        description="tiktoken encoding (cl100k_base) or Hugging Face repo id; with path: the name recorded in the manifest",
    )
    path: Path | None = Field(default=None, description="a Hugging Face tokenizer.json file")
    kind: Literal["huggingface", "tiktoken"] | None = Field(
        default=None, description="only to choose when a name is both a tiktoken encoding and a cached repo"
    )
    revision: str | None = Field(default=None, min_length=1, description="Hugging Face repo only: branch, tag or commit (default main)")
    bos_token: str | None = Field(default=None, description="prepended to every document when set")
    eos_token: str | None = Field(
        default=None, description="appended to every document; default: the encoding's own end-of-text token"
    )
    pad_token: str | None = Field(default=None, description="fills the tail of a sequence; defaults to eos_token")
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    add_special_tokens: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="special tokens a Hugging Face tokenizer lacks (FIM's), added after its vocabulary: new ids, new identity",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_pasted_regex(cls, data: object) -> object:
        """The old tiktoken form (path to a .tiktoken file + pattern + special_tokens) is told what replaces it.
        Empty values of those keys are dropped: manifests written before carry them in their recorded config."""
        if not isinstance(data, dict):
            return data
        configs.check([
            (key, f"no longer set by hand: {why}; name the encoding instead (tokenizer.name: cl100k_base)")
            for key, why in LEGACY_KEYS.items()
            if data.get(key)
        ])
        return {key: value for key, value in data.items() if key not in LEGACY_KEYS}

    @model_validator(mode="after")
    def _one_way_to_find_it(self) -> "TokenizerConfig":
        problems = []
        if self.name is None and self.path is None:
            problems.append((
                "name",
                "set tokenizer.name (a tiktoken encoding such as cl100k_base, or a Hugging Face repo id in the local "
                "cache) or tokenizer.path (a tokenizer.json file)",
            ))
        if self.path is not None and self.kind == "tiktoken":
            problems.append((
                "path",
                "a .tiktoken file holds only the BPE ranks, not the regex and special tokens; name the encoding "
                "instead (tokenizer.name: cl100k_base) and leave out path",
            ))
        if self.revision is not None and (self.path is not None or self.kind == "tiktoken"):
            problems.append(("revision", "applies to a Hugging Face repo id given as tokenizer.name only"))
        configs.check(problems)
        return self

    def resolved_against(self, base: Path) -> "TokenizerConfig":
        """A relative tokenizer.json path taken from `base` (the config file's directory); a name is left alone."""
        return self if self.path is None else self.model_copy(update={"path": base / self.path})


class ShardSource(StrictModel):
    """One deduplicated Parquet input of `Document` rows and its share of the mixture."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    path: str = Field(min_length=1, description="file or glob of Parquet files with DOCUMENT_SCHEMA rows")
    weight: float = Field(default=1.0, ge=0)


class FimSettings(StrictModel):
    """Fill-in-the-middle at tokenize time (ember/tokenize/fim.py): which documents, which order, which tokens.
    The tokens must be special tokens of the tokenizer; a tokenizer without them is refused before any work, unless
    `tokenizer.add_special_tokens` lists them (a Hugging Face tokenizer gets them as new ids)."""

    rate: float = Field(default=0.5, ge=0, le=1, description="share of documents FIM'd")
    spm_rate: float = Field(default=0.5, ge=0, le=1, description="share of FIM'd documents in SPM order (the rest PSM)")
    level: Literal["file", "repository"] = Field(
        default="file", description="with repository documents: FIM each file's text, or the whole repository document"
    )
    prefix_token: str = Field(default="<fim_prefix>", min_length=1)
    middle_token: str = Field(default="<fim_middle>", min_length=1)
    suffix_token: str = Field(default="<fim_suffix>", min_length=1)
    seed: int = Field(default=0, ge=0, lt=2**63)


class MixtureSettings(StrictModel):
    """Token budgets per source (ember/tokenize/mixtures.py): documents repeated or sampled, seeded by their ids."""

    total_tokens: int | None = Field(default=None, ge=1, description="the sources' weights share what budgets leave of it")
    budgets: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict, description="source name -> tokens")
    seed: int = Field(default=0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _something_to_plan(self) -> "MixtureSettings":
        if self.total_tokens is None and not self.budgets:
            raise ValueError("set total_tokens, budgets or both (without either there is nothing to resample)")
        return self


class RepositorySettings(StrictModel):
    """Repository-level documents (ember/pipelines/code/): a source's files grouped by a metadata field, ordered and
    rendered as one document (StarCoder2's layout by default). Documents without the field stay as they are."""

    field: Literal["repo"] = Field(default="repo", description="the metadata key naming a document's repository")
    order: Literal["dependency", "random", "path"] = "dependency"
    seed: int = Field(default=0, ge=0, lt=2**63, description="of the `random` order")
    repo_header: str = Field(default="<repo_name>{repo}", description="once per repository; {repo} is its name")
    file_header: str = Field(default="<file_sep>{path}\n", description="before each file; {path}, {repo}")
    sources: list[str] | None = Field(default=None, description="the sources grouped; default every source")


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
    fim: FimSettings | None = Field(default=None, description="fill-in-the-middle; off when absent")
    mixture: MixtureSettings | None = Field(default=None, description="token budgets per source; off when absent")
    repositories: RepositorySettings | None = Field(default=None, description="repository-level documents; off when absent")

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

    output_dir: Path | str = Field(description="a local directory, gs://BUCKET/... or s3://BUCKET/...")
    sources: list[ShardSource] = Field(min_length=1)

    @field_validator("output_dir")
    @classmethod
    def _local_path_or_url(cls, value: Path | str) -> Path | str:
        """A URL stays a string (a Path would fold gs:// into gs:/); a local directory is a Path."""
        return value if isinstance(value, Path) or is_url(value) else Path(value)

    @field_validator("sources")
    @classmethod
    def _unique_sources(cls, sources: list[ShardSource]) -> list[ShardSource]:
        return configs.unique_names(sources)

    @model_validator(mode="after")
    def _settings_name_sources(self) -> "TokenizeConfig":
        """Budgets and repository grouping name sources: a typo would silently budget or group nothing."""
        names = {s.name for s in self.sources}
        problems = []
        if self.mixture is not None:
            problems += [(f"mixture.budgets.{name}", f"no source is named {name!r} (sources: {sorted(names)})")
                         for name in self.mixture.budgets if name not in names]
        if self.repositories is not None and self.repositories.sources is not None:
            problems += [("repositories.sources", f"no source is named {name!r} (sources: {sorted(names)})")
                         for name in self.repositories.sources if name not in names]
        configs.check(problems)
        return self

    def config_hash(self, tokenizer_hash: str) -> str:
        """Hash of what determines the output bytes; the output directory itself is left out."""
        payload = self.model_dump(mode="json", exclude={"output_dir"})
        payload["tokenizer"]["path"] = None
        payload["tokenizer_hash"] = tokenizer_hash
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def parse_config(data: object, where: str = "config") -> TokenizeConfig:
    return configs.validate(TokenizeConfig, data, where, TokenizeConfigError)


def load_config(path: str | Path, data: bytes | None = None) -> TokenizeConfig:
    """A local file, or the bytes `data` of a config at URL `path` (read by the caller). Relative sources and
    output_dir resolve against the file's own directory (for a URL config, as URLs beside it); a relative
    tokenizer.path against a local config's directory, else the current one (a tokenizer file is read locally)."""
    if data is not None:
        config = parse_config(configs.parse_yaml_bytes(data, str(path), TokenizeConfigError), str(path))
        base: str | Path = str(path).rsplit("/", 1)[0]
        tokenizer = config.tokenizer
    else:
        path = Path(path)
        config = parse_config(configs.read_yaml_mapping(path, TokenizeConfigError), str(path))
        base = path.resolve().parent
        tokenizer = config.tokenizer.resolved_against(base)

    def resolve(location: Path | str) -> Path | str:
        if is_url(location):
            return location
        return f"{base}/{location}" if isinstance(base, str) else base / location

    return config.model_copy(
        update={
            "output_dir": resolve(config.output_dir),
            "tokenizer": tokenizer,
            "sources": [s.model_copy(update={"path": str(resolve(s.path))}) for s in config.sources],
        }
    )
