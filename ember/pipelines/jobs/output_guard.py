"""Outputs never destroy what ember did not write, and never show a half-written or mixed state.

A local output (a corpus build's directory, a shard set) is written into a fresh staging directory
next to its target - the same filesystem - and swapped in with one rename once everything in it is
complete; a failed or interrupted build leaves the previous complete output where it was. Before any
work, the target is checked: every file in it must be one ember wrote there (listed in the corpus
output's `OWNERSHIP_FILE`, or in a shard set's manifest), else the build refuses and deletes nothing.
The target's parent must be writable and have room for the new output next to the old one.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.files import write_atomically
from ember.pipelines.jobs.process import signals_deferred

OWNERSHIP_FILE = ".ember-output.json"
OWNERSHIP_SCHEMA = "ember.output_files"
MIN_FREE_BYTES = 64 * 1024 * 1024  # below this no build is worth starting, whatever its inputs
SHOWN_FOREIGN = 5


class OutputUnusable(Exception):
    """The output cannot be written safely; raised before any work, or (nothing replaced) before the swap."""


def is_local(path: str) -> bool:
    return "://" not in path


def files_under(directory: Path) -> list[str]:
    """Every file (and symlink) under `directory`, as sorted POSIX paths relative to it."""
    found = []
    for root, dirs, files in os.walk(directory):
        base = Path(root)
        found += [(base / name).relative_to(directory).as_posix() for name in files]
        found += [(base / name).relative_to(directory).as_posix() for name in dirs if (base / name).is_symlink()]
    return sorted(found)


def write_ownership(directory: Path, build_key: str | None = None) -> None:
    """Record every file now under `directory` (with its size) as ember's own; written last, like a manifest.
    `build_key` names the inputs and settings the output was built from, so a rerun can tell it is up to date."""
    files = [f for f in files_under(directory) if f != OWNERSHIP_FILE]
    payload: dict = {"schema": OWNERSHIP_SCHEMA, "version": 1, "files": files,
                     "sizes": {f: (directory / f).lstat().st_size for f in files}}
    if build_key is not None:
        payload["build_key"] = build_key
    write_atomically(directory / OWNERSHIP_FILE, (json.dumps(payload, indent=1) + "\n").encode("utf-8"))


def record_rewrites(directory: Path) -> None:
    """After ember rewrote files of a finished output in place (`corpus report`), record the new sizes of the files
    the ownership file already lists, under the same build key: a rerun of the build still finds it up to date. Only
    listed files are re-measured, so a file someone else added never becomes ember's to delete."""
    try:
        payload = json.loads((directory / OWNERSHIP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(payload, dict) or payload.get("schema") != OWNERSHIP_SCHEMA or not isinstance(payload.get("sizes"), dict):
        return
    payload["sizes"] = {f: (directory / f).lstat().st_size if (directory / f).exists() else size
                        for f, size in payload["sizes"].items()}
    write_atomically(directory / OWNERSHIP_FILE, (json.dumps(payload, indent=1) + "\n").encode("utf-8"))


def up_to_date(directory: Path, build_key: str) -> bool:
    """`directory` is a complete output built under `build_key`: its ownership file records that key and
    every file it lists is present with the recorded size."""
    try:
        payload = json.loads((directory / OWNERSHIP_FILE).read_text(encoding="utf-8"))
        if payload.get("schema") != OWNERSHIP_SCHEMA or payload.get("build_key") != build_key:
            return False
        return all((directory / f).lstat().st_size == size for f, size in payload["sizes"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def owned_by_ownership_file(directory: Path) -> set[str]:
    """The files a previous build listed as its own (none when the list is missing or unreadable)."""
    try:
        payload = json.loads((directory / OWNERSHIP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    files = payload.get("files") if isinstance(payload, dict) and payload.get("schema") == OWNERSHIP_SCHEMA else None
    return ({f for f in files if isinstance(f, str)} | {OWNERSHIP_FILE}) if isinstance(files, list) else set()


def refuse_foreign(target: Path, owned: set[str], what: str) -> None:
    """Raises when `target` holds anything ember did not write there; reads only, deletes nothing."""
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir() or target.is_symlink():
        raise OutputUnusable(f"{what} {target} exists and is not a directory; ember writes only into a directory of its own. "
                             "Move it away or choose another output path.")
    foreign = [f for f in files_under(target) if f not in owned]
    if foreign:
        shown = ", ".join(foreign[:SHOWN_FOREIGN]) + (f" and {len(foreign) - SHOWN_FOREIGN} more" if len(foreign) > SHOWN_FOREIGN else "")
        raise OutputUnusable(
            f"{what} {target} holds {len(foreign)} file(s) ember did not write there: {shown}. "
            "ember replaces only an output it wrote itself and never deletes other files; nothing was changed. "
            "Move those files away, or choose another output directory."
        )


def check_room(target: Path, need_bytes: int, what: str) -> None:
    """The target's parent can be created, written to, and holds `need_bytes` free - checked in seconds, before any work."""
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), parent)
        reason = f"{blocker} is not a directory" if not blocker.is_dir() else f"{exc.strerror or exc} ({exc.filename or parent})"
        raise OutputUnusable(
            f"{what} {target} cannot be written: {reason}. "
            f"ember builds the new output next to it in {parent}, which must be a writable directory; "
            "fix the permissions or mount, or choose another output path. Nothing was started."
        ) from None
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise OutputUnusable(
            f"{what} {target}: {parent} has {free / 2**20:,.0f} MiB free, the build needs at least "
            f"{need_bytes / 2**20:,.0f} MiB (the new output is written next to the old one before it replaces it). "
            "Free some space, choose another output path, or set the floor with --min-free-mb. Nothing was started."
        )


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where that is unavailable."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_in(staging: Path, target: Path) -> None:
    """`staging` becomes `target` in one step; the previous output (all ember's own) is removed afterwards."""
    if not target.exists():
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)
        return
    previous = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.previous-"))
    os.rename(target, previous / target.name)
    os.rename(staging, target)
    shutil.rmtree(previous)


@contextmanager
def staged(target: Path, owned: Callable[[Path], set[str]], what: str) -> Iterator[Path]:
    """A fresh, empty staging directory next to `target`, swapped in when the block completes.

    An exception inside the block removes the staging directory and leaves `target` untouched. The
    target is checked for foreign files again right before the swap (one may have appeared meanwhile).
    """
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.staging-"))
    os.chmod(staging, 0o755)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with signals_deferred():  # a stop signal during the swap takes effect once the swap is done
        try:
            refuse_foreign(target, owned(target), what)
        except OutputUnusable as exc:
            raise OutputUnusable(f"{exc} The new output is complete in {staging}.") from None
        swap_in(staging, target)
