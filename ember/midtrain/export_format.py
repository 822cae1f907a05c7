"""A policy export on disk (format 2) and the one reader every consumer of an export uses.

An export directory holds exactly three files: `model.safetensors`, `config.json` and `export.json`, the
manifest, which records the sha256 and size of each of the other two. The sha256 of the manifest's own bytes
is the export's digest, the one a policy announcement carries, so one digest pins every file: the weights
and the config that says how to read them.

Why one reader: checking a file and then using another (hashing a path, then reopening it) loads whatever was
swapped in between, and checking the weights alone lets an edited config.json through. `read_export` opens
each file once, reads it whole (at most the size the manifest records) and hashes those bytes;
`ExportFiles.load` then parses the same bytes. Before the weights are parsed, config.json is validated
(`PolicyConfig`: every size bounded, epsilon and RoPE base positive) and the parameters it describes must fit
in the weights file; after, every tensor's name, shape and dtype must be the config's.

Format 3 is a delta export (slime's delta weight sync is the anchor): `weights.delta.zst` instead of the weights, the
XOR of each tensor's bytes against the base version's (a previous export, named and pinned by its digest in
`base`), laid out as byte planes (Blosc's shuffle: every element's first byte, then every second byte, ...) and
zstd-compressed. Small updates leave the sign, exponent and high mantissa bits of most weights as they were, so
those planes are almost all zero bytes and compress to little; the low mantissa planes are noise either way. The manifest records the sha256 of every rebuilt tensor and
of the rebuilt `model.safetensors`, byte for byte the file a full export of the same weights holds: the reader
rebuilds it from the base (itself read and checked, a delta in turn back to the last full snapshot) and hands on
only bytes that match. A base that cannot be had is `DeltaBaseUnavailable`, never a guess.

Format 1 (a manifest naming the weights' sha256 alone) is refused: re-export the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Buffer
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal, Mapping

import torch
from pydantic import Field, StrictInt, ValidationError, field_validator, model_validator

from ember import configs
from ember.configs import StrictModel, at_most
from ember.files import write_atomically
from ember.midtrain.config import HIDDEN
from ember.schemas.wire_json import DecodeError, parse_json
from ember.tokenize.config import MAX_SEQ_LEN, SEQ_LEN_WHY

FORMAT = 2
DELTA_FORMAT = 3
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DELTA_FILE = "weights.delta.zst"
MANIFEST_FILE = "export.json"
EXPORTED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
DELTA_FILES = (CONFIG_FILE, DELTA_FILE)
DELTA_ZSTD_LEVEL = 1
"""A delta's byte planes are near-zero (sign, exponent, high mantissa) or noise (low mantissa): higher levels find
nothing more (36.8% of the bytes at level 3, 36.7% at 1, fp32 moved by 1e-5) and compress at a third of the speed."""
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A delta's manifest holds a checksum per tensor (about 120 bytes each): 16 MiB is over 100,000 tensors, ten
times a large MoE's; a larger export.json is not one ember wrote."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyFetchError(ValueError):
    """An export that cannot be used: unreachable, incomplete, altered, an old format, or not the announced one."""


class DeltaBaseUnavailable(PolicyFetchError):
    """A delta export whose base cannot be had (removed, never fetched, altered): its weights cannot be rebuilt."""


class FileEntry(StrictModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: StrictInt = Field(ge=0)


def _exactly(files: dict[str, FileEntry], names: tuple[str, ...]) -> dict[str, FileEntry]:
    if sorted(files) != sorted(names):
        raise ValueError(f"must list exactly {', '.join(names)}, got {', '.join(sorted(files)) or 'none'}")
    return files


class Manifest(StrictModel):
    """export.json: what the export holds, byte for byte, and where it came from."""

    format: Literal[2]
    files: dict[str, FileEntry]
    source_checkpoint: str = Field(min_length=1)
    policy_version: StrictInt | None = Field(default=None, ge=0)
    step: StrictInt | None = Field(default=None, ge=0)

    @field_validator("files")
    @classmethod
    def _exactly_the_exported_files(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        return _exactly(files, EXPORTED_FILES)

    def encode(self) -> bytes:
        return (self.model_dump_json(indent=2, exclude_none=True) + "\n").encode()


class BaseRef(StrictModel):
    """The export a delta applies to: its directory's name beside this one, and its digest (export.json's sha256)."""

    name: str = Field(pattern=r"^version_[0-9]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DeltaManifest(StrictModel):
    """export.json of a delta export: the files it holds, the base it applies to, and what the rebuilt weights
    hash to, per tensor and as the whole model.safetensors a full export would hold."""

    format: Literal[3]
    files: dict[str, FileEntry]
    base: BaseRef
    chain: StrictInt = Field(ge=1, description="deltas since the last full snapshot, this one included")
    weights: FileEntry
    tensors: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(min_length=1)
    source_checkpoint: str = Field(min_length=1)
    policy_version: StrictInt | None = Field(default=None, ge=0)
    step: StrictInt | None = Field(default=None, ge=0)

    @field_validator("files")
    @classmethod
    def _exactly_the_delta_files(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        return _exactly(files, DELTA_FILES)

    def encode(self) -> bytes:
        return (self.model_dump_json(indent=2, exclude_none=True) + "\n").encode()


class EmberInfo(StrictModel):
    tokenizer: str = Field(min_length=1)
    tokenizer_vocab_size: StrictInt = Field(gt=0)


Positive = Annotated[float, Field(gt=0)]


class PolicyConfig(StrictModel):
    """config.json as this reader takes it: Mixtral's keys, each size within the bounds the trainer's own config
    enforces (so whatever ember trains, it can load), epsilon and RoPE base positive. Keys a Mixtral server
    honours that this forward pass does not (a sliding window, tied embeddings) are refused, not ignored."""

    architectures: tuple[Literal["MixtralForCausalLM"]]
    model_type: Literal["mixtral"]
    vocab_size: Annotated[StrictInt, at_most(2**23, "the trainer's vocabulary bound (2**22) padded")] = Field(gt=0)
    hidden_size: Annotated[StrictInt, HIDDEN] = Field(gt=0)
    intermediate_size: Annotated[StrictInt, HIDDEN] = Field(gt=0)
    num_hidden_layers: Annotated[StrictInt, at_most(1024, "over five times the deepest published transformer")] = Field(gt=0)
    num_attention_heads: Annotated[StrictInt, at_most(1024, "over ten times any published model")] = Field(gt=0)
    num_key_value_heads: StrictInt = Field(gt=0)
    head_dim: Annotated[StrictInt, at_most(4096, "over sixteen times any published model")] = Field(gt=0)
    hidden_act: Literal["silu"]
    max_position_embeddings: Annotated[StrictInt, at_most(MAX_SEQ_LEN, SEQ_LEN_WHY)] = Field(gt=0)
    rms_norm_eps: Positive = Field(le=1)
    rope_theta: Positive
    sliding_window: None
    attention_dropout: float = Field(ge=0, lt=1)
    num_local_experts: Annotated[StrictInt, at_most(4096, "over ten times any published MoE")] = Field(gt=0)
    num_experts_per_tok: Annotated[StrictInt, at_most(64, "each token is dispatched to this many experts")] = Field(gt=0)
    router_aux_loss_coef: float = Field(ge=0)
    output_router_logits: bool
    tie_word_embeddings: Literal[False]
    initializer_range: Positive
    torch_dtype: Literal["float32", "bfloat16", "float16"]
    use_cache: bool
    ember: EmberInfo

    @model_validator(mode="after")
    def _consistent(self) -> "PolicyConfig":
        problems: list[str | tuple[str, str]] = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(("num_key_value_heads", f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}"))
        if self.head_dim % 2:
            problems.append(("head_dim", f"{self.head_dim} is odd: rotate-half RoPE splits it in two"))
        if self.num_experts_per_tok > self.num_local_experts:
            problems.append(("num_experts_per_tok", f"{self.num_experts_per_tok} exceeds num_local_experts {self.num_local_experts}"))
        if self.ember.tokenizer_vocab_size > self.vocab_size:
            problems.append(("ember.tokenizer_vocab_size", f"{self.ember.tokenizer_vocab_size} exceeds vocab_size {self.vocab_size}"))
        configs.check(problems)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def parameter_count(self) -> int:
        """The parameters `tensor_shapes` describes, without building it (a config may describe billions)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = 2 * h + q * h + 2 * kv * h + h * q + self.num_local_experts * (h + 3 * self.intermediate_size * h)
        return 2 * self.vocab_size * h + h + self.num_hidden_layers * per_layer

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward pass reads, under Mixtral's names, at the shape this config gives it."""
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (self.vocab_size, h),
        }
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "block_sparse_moe.gate.weight": (self.num_local_experts, h),
            }
            for expert in range(self.num_local_experts):
                e = f"{p}block_sparse_moe.experts.{expert}."
                shapes |= {e + "w1.weight": (f, h), e + "w3.weight": (f, h), e + "w2.weight": (h, f)}
        return shapes


def sha256(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_object(raw: bytes, where: Path) -> dict:
    try:
        data = parse_json(raw, str(where))
    except DecodeError as exc:
        raise PolicyFetchError(str(exc)) from None
    if not isinstance(data, dict):
        raise PolicyFetchError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def _validated(model: type[configs.Model], data: dict, where: Path) -> configs.Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise PolicyFetchError(f"{where}: {'; '.join(configs.error_lines(exc, model=model))}") from None


def _read(path: Path, limit: int) -> bytes:
    """The file's bytes through one open: at most `limit` + 1 (so that a longer file shows), and never more
    than the file holds, so a size claimed in a manifest allocates nothing the file does not back."""
    try:
        with path.open("rb") as handle:
            return handle.read(min(limit, os.fstat(handle.fileno()).st_size) + 1)
    except FileNotFoundError:
        raise PolicyFetchError(f"{path}: missing from the export") from None
    except OSError as exc:
        raise PolicyFetchError(f"{path}: cannot be read ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class ExportFiles:
    """An export's files as read and checked: `load` parses exactly these bytes, never the paths again."""

    path: Path
    sha256: str  # of MANIFEST_FILE's bytes: the digest an announcement carries
    manifest: Manifest | DeltaManifest
    files: Mapping[str, bytes]  # config.json and model.safetensors (a delta's rebuilt and checked)

    @property
    def uri(self) -> str:
        return self.path.resolve().as_uri()

    def config(self) -> PolicyConfig:
        where = self.path / CONFIG_FILE
        return _validated(PolicyConfig, _json_object(self.files[CONFIG_FILE], where), where)

    def load(self) -> tuple[PolicyConfig, dict[str, torch.Tensor]]:
        """The validated config and the weights, parsed from the checked bytes after the config's parameters
        are known to fit in them; every tensor's name, shape and dtype are then the config's."""
        config = self.config()
        where, raw = self.path / WEIGHTS_FILE, self.files[WEIGHTS_FILE]
        needed = config.parameter_count() * config.dtype.itemsize
        if needed > len(raw):
            raise PolicyFetchError(
                f"{self.path / CONFIG_FILE} describes {config.parameter_count():,} {config.torch_dtype} parameters "
                f"({needed:,} bytes), {where} holds {len(raw):,} bytes: the config is not these weights'"
            )
        tensors = _tensors(raw, where)
        expected = config.tensor_shapes()
        missing, extra = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
        if missing or extra:
            raise PolicyFetchError(
                f"{where}: tensors differ from what {CONFIG_FILE} describes (missing: {', '.join(missing[:3]) or 'none'}; "
                f"unexpected: {', '.join(extra[:3]) or 'none'})"
            )
        for name, shape in expected.items():
            found = tensors[name]
            if tuple(found.shape) != shape or found.dtype != config.dtype:
                raise PolicyFetchError(
                    f"{where}: {name} is {found.dtype} {list(found.shape)}, {CONFIG_FILE} says {config.dtype} {list(shape)}"
                )
        return config, tensors


BaseResolver = Callable[[BaseRef], "ExportFiles"]
"""Reads a delta's base (its weights rebuilt and checked); a consumer's own (an object store, a copy in memory)."""


def _tensor_bytes(tensor: torch.Tensor):
    """The tensor's bytes as a uint8 array viewing its storage (no copy): hashed and XOR-ed in place."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensors(raw: bytes, where: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(raw)
    except SafetensorError as exc:
        raise PolicyFetchError(f"{where}: not a safetensors file ({exc})") from None


def encode_delta(weights: bytes, base_weights: bytes) -> tuple[bytes, dict[str, str]] | None:
    """The zstd-compressed XOR of each tensor's bytes against the base's (tensors in name order, each as byte planes:
    every element's first byte, then every second byte, ...), and the sha256 of each tensor of `weights`; None when the two do not hold the same tensors at the same shapes and dtypes (a
    delta would not apply: export in full)."""
    import numpy as np
    import zstandard

    new, old = _tensors(weights, Path(WEIGHTS_FILE)), _tensors(base_weights, Path(WEIGHTS_FILE))
    if new.keys() != old.keys() or any((t.dtype, t.shape) != (old[n].dtype, old[n].shape) for n, t in new.items()):
        return None
    xored, checksums, at = np.empty(sum(t.numel() * t.element_size() for t in new.values()), np.uint8), {}, 0
    for name in sorted(new):
        raw, size = _tensor_bytes(new[name]), new[name].element_size()
        checksums[name] = sha256(raw)
        planes = xored[at:at + raw.size].reshape(size, -1)
        np.bitwise_xor(raw.reshape(-1, size).T, _tensor_bytes(old[name]).reshape(-1, size).T, out=planes)
        at += raw.size
    return zstandard.ZstdCompressor(level=DELTA_ZSTD_LEVEL).compress(xored), checksums


def _rebuild(base: "ExportFiles", delta: bytes, manifest: DeltaManifest, path: Path) -> bytes:
    """model.safetensors from the base's checked weights and the delta: every tensor's bytes against its recorded
    sha256, then the serialized file against the sha256 and size a full export of these weights records."""
    import numpy as np
    import zstandard
    from safetensors.torch import save

    where = path / DELTA_FILE
    old = _tensors(base.files[WEIGHTS_FILE], base.path / WEIGHTS_FILE)
    if sorted(old) != sorted(manifest.tensors):
        raise PolicyFetchError(f"{where}: the base {manifest.base.name} holds other tensors than {MANIFEST_FILE} lists")
    total = sum(t.numel() * t.element_size() for t in old.values())
    try:
        xored = zstandard.ZstdDecompressor().decompress(delta, max_output_size=total)
    except zstandard.ZstdError as exc:
        raise PolicyFetchError(f"{where}: not a zstd stream of at most {total:,} bytes ({exc})") from None
    if len(xored) != total:
        raise PolicyFetchError(f"{where}: {len(xored):,} bytes of XOR, the base's tensors hold {total:,}")
    rebuilt, at = {}, 0
    for name in sorted(old):
        before, size = old[name], old[name].element_size()
        planes = np.frombuffer(xored, np.uint8, before.numel() * size, at).reshape(size, -1)
        raw = np.bitwise_xor(_tensor_bytes(before).reshape(-1, size), planes.T, order="C").reshape(-1)
        at += raw.size
        if (actual := sha256(raw)) != manifest.tensors[name]:
            raise PolicyFetchError(f"{where}: tensor {name} rebuilds to sha256 {actual}, {MANIFEST_FILE} records {manifest.tensors[name]}")
        rebuilt[name] = torch.from_numpy(raw).view(before.dtype).reshape(before.shape)
    weights = save(rebuilt, metadata={"format": "pt"})
    if (actual := sha256(weights)) != manifest.weights.sha256 or len(weights) != manifest.weights.size:
        raise PolicyFetchError(
            f"{path / WEIGHTS_FILE} rebuilds to sha256 {actual} ({len(weights):,} bytes), {MANIFEST_FILE} records "
            f"{manifest.weights.sha256} ({manifest.weights.size:,} bytes)"
        )
    return weights


def listed_files(manifest: bytes) -> tuple[str, ...]:
    """The files an export with this manifest holds besides it, by its format (what to fetch before `read_export`
    checks them); a manifest that does not parse gets a full export's, and `read_export` then refuses it."""
    try:
        delta = json.loads(manifest).get("format") == DELTA_FORMAT
    except (ValueError, AttributeError):
        delta = False
    return DELTA_FILES if delta else EXPORTED_FILES


def _siblings(path: Path) -> BaseResolver:
    """A base beside the delta on disk, read (and, a delta in turn, rebuilt) by this same reader."""
    return lambda ref: read_export(path.parent / ref.name, ref.sha256, _siblings(path.parent / ref.name))


def read_export(path: Path, announced_sha256: str | None = None, base: BaseResolver | None = None) -> ExportFiles:
    """The export at `path`, each file read once and checked: the manifest against `announced_sha256` (None: the
    manifest is taken as found, as the trainer does for its own export), every other file against the manifest,
    and the directory holding nothing else. A delta (format 3) is rebuilt on its base, which `base` reads (default:
    the directory beside this one, back to the last full snapshot) and which must hash as the manifest pins; the
    result holds the rebuilt model.safetensors, as a full export of the same weights would."""
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise PolicyFetchError(f"{path}: no such export directory (removed by the trainer's keep_versions, or never written)")
    raw = _read(manifest_path, MAX_MANIFEST_BYTES)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise PolicyFetchError(f"{manifest_path}: over {MAX_MANIFEST_BYTES:,} bytes, not a manifest ember wrote")
    digest = sha256(raw)
    if announced_sha256 is not None and digest != announced_sha256:
        raise PolicyFetchError(f"{manifest_path} hashes to {digest}, the announcement says {announced_sha256}: not the announced export")
    data = _json_object(raw, manifest_path)
    if data.get("format") not in (FORMAT, DELTA_FORMAT):
        raise PolicyFetchError(
            f"{manifest_path}: export format {data.get('format', 1)!r}, this reader takes formats {FORMAT} (a manifest "
            f"that pins every file) and {DELTA_FORMAT} (a delta); re-export the checkpoint with `midtrain export-hf`"
        )
    manifest = _validated(Manifest if data["format"] == FORMAT else DeltaManifest, data, manifest_path)
    unlisted = sorted(set(os.listdir(path)) - {MANIFEST_FILE, *manifest.files})
    if unlisted:
        raise PolicyFetchError(f"{path}: {', '.join(unlisted[:5])} not listed in {MANIFEST_FILE}; an export holds only the files it pins")
    files = {}
    for name, entry in manifest.files.items():
        content = _read(path / name, entry.size)
        if len(content) != entry.size:
            size = f"{len(content):,} bytes" if len(content) <= entry.size else f"over {entry.size:,} bytes"
            raise PolicyFetchError(f"{path / name}: {size}, {MANIFEST_FILE} records {entry.size:,}: the file changed")
        if (actual := sha256(content)) != entry.sha256:
            raise PolicyFetchError(f"{path / name} hashes to {actual}, {MANIFEST_FILE} records {entry.sha256}: the file changed")
        files[name] = content
    if isinstance(manifest, DeltaManifest):
        ref = manifest.base
        try:
            base_files = (base or _siblings(path))(ref)
        except PolicyFetchError as exc:
            raise DeltaBaseUnavailable(
                f"{path}: a delta on {ref.name} (export.json sha256 {ref.sha256[:12]}...), which cannot be used: {exc}"
            ) from None
        if base_files.sha256 != ref.sha256:
            raise DeltaBaseUnavailable(f"{path}: a delta on {ref.name} {ref.sha256}, the base found hashes to {base_files.sha256}")
        files[WEIGHTS_FILE] = _rebuild(base_files, files.pop(DELTA_FILE), manifest, path)
    return ExportFiles(path, digest, manifest, files)


def _seal(tmp: Path, files: Mapping[str, bytes], manifest: type[configs.Model], **fields) -> str:
    entries = {}
    for name, data in files.items():
        write_atomically(tmp / name, data)
        entries[name] = FileEntry(sha256=sha256(data), size=len(data))
    raw = manifest(files=entries, **fields).encode()
    write_atomically(tmp / MANIFEST_FILE, raw)
    return sha256(raw)


def seal(tmp: Path, files: Mapping[str, bytes], source_checkpoint: Path, **provenance: int) -> str:
    """Writes `files` and their manifest into `tmp` (each fsync'd); returns the manifest's digest.
    Each file is hashed from the bytes written, not read back."""
    return _seal(tmp, files, Manifest, format=FORMAT, source_checkpoint=str(source_checkpoint.resolve()), **provenance)


def seal_delta(
    tmp: Path, config: bytes, delta: bytes, weights: bytes, checksums: Mapping[str, str], base: BaseRef, chain: int,
    source_checkpoint: Path, **provenance: int,
) -> str:
    """As `seal`, for a delta export: config.json and the delta written, the full `weights` (not written) recorded
    by sha256 and size along with each tensor's `checksums`, so the reader can prove its rebuild."""
    return _seal(
        tmp, {CONFIG_FILE: config, DELTA_FILE: delta}, DeltaManifest, format=DELTA_FORMAT, base=base, chain=chain,
        weights=FileEntry(sha256=sha256(weights), size=len(weights)), tensors=dict(checksums),
        source_checkpoint=str(source_checkpoint.resolve()), **provenance,
    )
