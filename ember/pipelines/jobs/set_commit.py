"""A file set (a shard set) written by the workers straight to its final location, committed by its manifest.

Workers share no disk with the driver on Dataflow or a remote Flink cluster, so each writes its own files through
Beam's FileSystems (`ember.storage`) under a deterministic name: a retried bundle overwrites its earlier attempt's
file instead of adding a second one. The worker that writes a file reports its size and sha256 from the bytes it
wrote; the manifest is written last, only after every listed file is found at its reported size.

On an object store a replaced set is written under a fresh prefix (`fresh_prefix`) beside the old one, and the
manifest's single write switches readers from the old set to the new (an object appears whole when its upload
completes); only then are the old set's files, and anything under the new prefix the manifest does not list (a
failed attempt's leftovers), deleted (`retire`). A reader sees the old set or the new set, never neither.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from pathlib import Path

from apache_beam.options.pipeline_options import PipelineOptions

from ember import storage
from ember.files import write_atomically
from ember.pipelines.jobs.output_guard import OutputUnusable
from ember.pipelines.jobs.runners import runner_name, runs_locally

PREFIX_STEM = "set-"


def fresh_prefix(previous: set[str]) -> str:
    """"" for a location that holds no set (the files go where a local set has them), else a new directory name
    that no file of the previous set uses."""
    if not previous:
        return ""
    taken = {name.split("/", 1)[0] for name in previous}
    while (prefix := f"{PREFIX_STEM}{uuid.uuid4().hex[:12]}") in taken:
        continue
    return prefix


def relative(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def write_file(directory: str, name: str, data: bytes) -> dict:
    """`data` as `directory`/`name` (a local file renamed into place, or an object), and what the manifest needs of it:
    its name, size and sha256, taken from the bytes written."""
    if storage.is_url(directory):
        storage.write_bytes(storage.join(directory, name), data)
    else:
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
    return {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_written(directory: str, sizes: dict[str, int]) -> None:
    """Before the manifest: every file the workers reported is at `directory` at its reported size, or the commit
    stops here (no manifest, so no reader takes the set) naming what is wrong."""
    present = storage.list_files(directory)
    wrong = sorted(name for name, size in sizes.items() if present.get(name) != size)
    if wrong:
        shown = ", ".join(f"{n} ({present.get(n, 'missing')} bytes, reported {sizes[n]})" for n in wrong[:5])
        raise RuntimeError(f"{directory}: {len(wrong)} written file(s) are missing or of another size: {shown}; "
                           "no manifest written")


def retire(location: str, prefix: str, listed: set[str], previous: set[str]) -> list[str]:
    """After the new manifest is in place at `location`: deletes the previous set's files that the new one does not
    list, and the files under the new set's `prefix` that its manifest does not list (attempts that failed). Returns
    the deleted names."""
    under = {n for n in storage.list_files(location) if prefix and n.startswith(f"{prefix}/")}
    stale = sorted((previous | under) - listed)
    storage.delete([storage.join(location, name) for name in stale])
    return stale


def unlisted_attempts(files: Iterable[str]) -> set[str]:
    """The files under a `fresh_prefix` directory at a set's location: an earlier replacement's, whose manifest was
    never written (it failed) or whose retirement did not finish; ember's own, so a later replacement deletes them."""
    return {name for name in files if "/" in name and name.split("/", 1)[0].startswith(PREFIX_STEM)}


TO_A_URL = "write to gs://BUCKET/... or s3://BUCKET/... instead"
NAMED_TOKENIZER = "name a tokenizer the workers have installed (tokenizer.name) instead"


def refuse_unshared_disk(path: str | Path, options: PipelineOptions, key: str, fix: str = TO_A_URL) -> None:
    """A local path with a runner whose workers do not share this machine's disk would be read or written on the
    workers' machines, or fail there, after the work began: refused before any, naming the fix."""
    if not storage.is_url(path) and not runs_locally(options):
        raise OutputUnusable(
            f"{key}: {path} is a local path, but the {runner_name(options)} workers do not share this machine's disk; "
            f"{fix}"
        )
