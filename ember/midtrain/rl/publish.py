"""Policy versions written where the sampler reads them: exported under run_dir/versions, full or as a delta on the
previous version, then (with `rl.publish_uri`) uploaded to gs:// or s3://, the URI an announcement carries.

Why a delta: consecutive RL versions differ by a few optimizer steps, so XOR-ing each tensor's bytes against the
previous version's leaves mostly zero bytes, which zstd shrinks (`export_format.encode_delta`; slime's delta
weight sync is the anchor). Every `full_every_k`-th version is a full snapshot, so a sampler that joins late walks
at most k - 1 deltas forward from it, and `keep_versions` >= `full_every_k` keeps that chain on the store. A
restarted run's first export is full (the previous weights left memory with the old process), unless the resumed
version's export is on disk: it is read back, checked, and is the next delta's base.

An upload is committed as the corpus commits a shard set (`storage.commit_files`): the files first, checked at their
sizes, export.json last, so a reader that starts from the manifest never sees half an export. Old versions are
removed manifest first, for the same reason.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ember import storage
from ember.midtrain.config import ModelConfig, MoEConfig, RLConfig
from ember.midtrain.export_format import (
    CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, BaseRef, DeltaManifest, encode_delta, read_export, seal, seal_delta,
)
from ember.midtrain.export_hf import export_files, write_export

VERSION_DIR = re.compile(r"version_(\d+)")


@dataclass(frozen=True)
class Published:
    uri: str  # what the announcement carries: the local export's file:// URI or its copy on the object store
    sha256: str  # of its export.json
    delta: bool
    bytes: int  # of the files written (config.json, the weights or the delta, export.json)


@dataclass
class _Previous:
    name: str
    sha256: str
    weights: bytes  # model.safetensors, as a full export holds it: the base of the next delta
    chain: int  # deltas since the last full snapshot


class VersionPublisher:
    """Rank 0's writer of policy versions (the run's only one), holding the last version's weights for the next delta."""

    def __init__(
        self, local_dir: Path, model: ModelConfig, moe: MoEConfig, *, publish_uri: str | None = None,
        full_every_k: int = 1, keep_versions: int = 4,
    ):
        self.local_dir, self.model, self.moe = local_dir, model, moe
        self.uri, self.full_every_k, self.keep = publish_uri, full_every_k, keep_versions
        self.previous: _Previous | None = None
        if self.uri is not None:
            storage.preflight(self.uri, write=True)

    @classmethod
    def for_run(cls, config: RLConfig) -> "VersionPublisher":
        rl = config.rl
        return cls(
            config.versions_dir, config.model, config.moe, publish_uri=rl.publish_uri, full_every_k=rl.full_every_k,
            keep_versions=rl.keep_versions,
        )

    def publish(self, checkpoint: Path, version: int, step: int) -> Published:
        """Version `version` of `checkpoint`'s policy, exported and (with a publish_uri) uploaded. An export left by
        a run that died before announcing it is read back through the checked reader and published as is."""
        out = self.local_dir / f"version_{version}"
        if out.exists():
            exported = read_export(out)
            exported.load()
            if exported.manifest.source_checkpoint != str(checkpoint.resolve()):
                raise ValueError(f"{out} was exported from {exported.manifest.source_checkpoint}, not {checkpoint}: another lineage of this run")
            digest, weights = exported.sha256, exported.files[WEIGHTS_FILE]
            chain = exported.manifest.chain if isinstance(exported.manifest, DeltaManifest) else 0
        else:
            files = export_files(checkpoint, self.model, self.moe)
            weights, provenance = files[WEIGHTS_FILE], {"policy_version": version, "step": step}
            previous = self.previous
            delta = encode_delta(weights, previous.weights) if previous and previous.chain + 1 < self.full_every_k else None
            if delta is None:
                chain, digest = 0, write_export(out, lambda tmp: seal(tmp, files, checkpoint, **provenance)).sha256
            else:
                chain = previous.chain + 1
                base = BaseRef(name=previous.name, sha256=previous.sha256)
                digest = write_export(out, lambda tmp: seal_delta(
                    tmp, files[CONFIG_FILE], delta[0], weights, delta[1], base, chain, checkpoint, **provenance,
                )).sha256
        self.previous = _Previous(out.name, digest, weights, chain)
        uri = out.resolve().as_uri() if self.uri is None else self._upload(out)
        self._drop_old()
        return Published(uri, digest, chain > 0, sum(storage.list_files(out).values()))

    def _upload(self, out: Path) -> str:
        target = storage.join(self.uri, out.name)
        names = sorted(storage.list_files(out))
        for name in [n for n in names if n != MANIFEST_FILE]:
            storage.upload(out / name, storage.join(target, name))
        present = storage.list_files(target)
        wrong = [n for n in names if n != MANIFEST_FILE and present.get(n) != (out / n).stat().st_size]
        if wrong:
            raise storage.StorageError(f"{target}: {', '.join(wrong)} missing or truncated after upload; no {MANIFEST_FILE} written")
        storage.upload(out / MANIFEST_FILE, storage.join(target, MANIFEST_FILE))
        return target

    def _drop_old(self) -> None:
        """Exports beyond the newest keep_versions, here and on the store, and temporaries of exports a killed run
        left behind (this rank is the run's only writer and is not exporting now)."""
        found = sorted((int(m.group(1)), p) for p in self.local_dir.iterdir() if (m := VERSION_DIR.fullmatch(p.name)))
        for old in [p for _, p in found[: -self.keep]] + list(self.local_dir.glob(".version_*.tmp")):
            shutil.rmtree(old)
        if self.uri is None:
            return
        stored: dict[int, list[str]] = {}
        for name in storage.list_files(self.uri):
            top, _, rest = name.partition("/")
            if (m := VERSION_DIR.fullmatch(top)) and rest:
                stored.setdefault(int(m.group(1)), []).append(name)
        for version in sorted(stored)[: -self.keep]:
            names = sorted(stored[version], key=lambda n: not n.endswith("/" + MANIFEST_FILE))
            storage.delete([storage.join(self.uri, n) for n in names[:1]])
            storage.delete([storage.join(self.uri, n) for n in names[1:]])
