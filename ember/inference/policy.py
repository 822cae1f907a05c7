"""A published policy in transformers: the export read and verified once, then loaded as `MixtralForCausalLM`.

The sampler is an implementation ember did not write: transformers maps the export's Mixtral names onto its
own modules (its weight converters fuse the experts), so a wrong weight mapping in ember's exporter shows up as a
mismatch against the trainer, not as two copies of the same mistake. Loading is strict: a tensor transformers
does not take, or one it expects and does not find, refuses the export.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from ember import storage
from ember.midtrain.export_format import (
    MANIFEST_FILE, MAX_MANIFEST_BYTES, BaseRef, ExportFiles, PolicyConfig, PolicyFetchError, listed_files, read_export,
)
from ember.midtrain.hf_policy import local_path


@dataclass
class LoadedPolicy:
    """One verified version in memory: the model, its config, and the digest and version it was announced with."""

    model: torch.nn.Module
    config: PolicyConfig
    version: int
    sha256: str
    uri: str
    files: ExportFiles  # the checked bytes, kept as the base a delta on this version is rebuilt from


def mixtral_config(config: PolicyConfig):
    """transformers' MixtralConfig from the verified config.json (ember's own keys left out)."""
    from transformers import MixtralConfig

    values = config.model_dump(mode="json", exclude={"ember", "architectures", "model_type", "torch_dtype"})
    return MixtralConfig(**values, dtype=config.torch_dtype, architectures=list(config.architectures))


def _fetch(location: str, limit: int | None = None) -> bytes:
    try:
        return storage.read_bytes(location, limit)
    except Exception as exc:  # noqa: BLE001 - each store's client raises its own types; any of them means no export
        raise PolicyFetchError(f"{location}: cannot be fetched ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _sibling(uri: str, name: str) -> str:
    if urlparse(uri).scheme in storage.SCHEMES:
        return storage.join(uri.rstrip("/").rsplit("/", 1)[0], name)
    return local_path(uri).parent.joinpath(name).as_uri()


def _bases(uri: str, known: ExportFiles | None):
    """A delta's base: `known` (the version in use) when it is the one pinned, so a sampler that follows every
    version fetches only deltas; else the export beside `uri`, read by `read_announced` in turn, back to the last
    full snapshot (a sampler that joined late)."""
    def resolve(ref: BaseRef) -> ExportFiles:
        if known is not None and known.sha256 == ref.sha256:
            return known
        return read_announced(_sibling(uri, ref.name), ref.sha256, known)
    return resolve


def read_announced(uri: str, sha256: str, known: ExportFiles | None = None) -> ExportFiles:
    """The export at `uri` (file://, gs:// or s3://), every file checked by `read_export` (a delta rebuilt on its
    base, `_bases`). An object-store export is copied into a private temporary directory first (export.json first,
    checked against `sha256` before anything else is fetched) and read from there once: what is verified is what
    is loaded."""
    if urlparse(uri).scheme not in storage.SCHEMES:
        return read_export(local_path(uri), sha256, _bases(uri, known))
    with tempfile.TemporaryDirectory(prefix="ember-policy-") as tmp:
        manifest = _fetch(storage.join(uri, MANIFEST_FILE), MAX_MANIFEST_BYTES)
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise PolicyFetchError(f"{storage.join(uri, MANIFEST_FILE)}: over {MAX_MANIFEST_BYTES:,} bytes, not a manifest ember wrote")
        if (digest := hashlib.sha256(manifest).hexdigest()) != sha256:
            raise PolicyFetchError(f"{storage.join(uri, MANIFEST_FILE)} hashes to {digest}, the announcement says {sha256}: not the announced export")
        (Path(tmp) / MANIFEST_FILE).write_bytes(manifest)
        for name in listed_files(manifest):
            (Path(tmp) / name).write_bytes(_fetch(storage.join(uri, name)))
        try:
            return read_export(Path(tmp), sha256, _bases(uri, known))
        except PolicyFetchError as exc:  # name the object, not the private copy
            raise type(exc)(str(exc).replace(tmp, uri.rstrip("/"))) from None


def load_policy(uri: str, sha256: str, version: int, known: LoadedPolicy | None = None) -> LoadedPolicy:
    """The export at `uri` whose export.json hashes to `sha256` (every file checked: `read_announced`; a delta on
    `known`'s version rebuilt from the bytes `known` was loaded from), in transformers. Raises PolicyFetchError naming
    the file for an export that is not the announced one or does not load."""
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    files = read_announced(uri, sha256, known.files if known else None)
    try:
        config, tensors = files.load()
    except PolicyFetchError as exc:
        if urlparse(uri).scheme in storage.SCHEMES:  # name the object, not the private copy
            raise PolicyFetchError(str(exc).replace(str(files.path), uri.rstrip("/"))) from None
        raise
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its "weights were not initialized" notice is what `info` below refuses
    hf_logging.disable_progress_bar()  # a bar per swap, in a worker's log
    try:
        model, info = MixtralForCausalLM.from_pretrained(
            None, config=mixtral_config(config), state_dict=tensors, output_loading_info=True, dtype=config.dtype,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    problems = {key: sorted(info.get(key) or []) for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    problems = {key: value for key, value in problems.items() if value}
    if problems:
        detail = "; ".join(f"{key}: {', '.join(map(str, value[:3]))}" for key, value in problems.items())
        raise PolicyFetchError(f"{files.path}: transformers' MixtralForCausalLM does not take these weights ({detail})")
    logging.getLogger(__name__).info("loaded policy version %d from %s (%s)", version, uri, sha256[:12])
    return LoadedPolicy(model.eval(), config, version, files.sha256, uri, files)
