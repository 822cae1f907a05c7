"""Source trees on a local disk as corpus input (`format: files`): which files of a repository become documents.

A repository is one directory that a source's input glob matches. Its files are walked in sorted order, so
the same tree gives the same units in the same order. `.git/` is skipped, and so is whatever the
repository's `.gitignore` files ignore (nested ones too, with git's precedence: the deepest file that has
a matching pattern decides, its last match wins; pathspec's `GitIgnoreSpec` does the matching). Ignored
paths are counted, not rejected: the user asked for them to be left out; an ignored directory is not entered.

Symlinks never lead out of the repository: a link whose target lies outside the root (or in `.git/`) is a
`symlink_outside_root` reject naming the link, never followed. A link inside is followed once: a file link
is read as the file it names, a directory link is walked unless its target is one of its own ancestors
(`symlink_loop`) or was already walked through another link (`symlink_repeat`), so no tree is walked more
than twice (once as itself, once through a link) whatever its links.

The repository's name is its git remote (`origin`, else the first) read from `.git/config` without running
git, as `owner/name`; without one it is the directory's name. Its licence is the SPDX id (lower case) of
its licence file (LICENSE, LICENCE, COPYING, UNLICENSE with .txt/.md/.rst or a `-` suffix), identified by
`identify` (edit distance to the choosealicense.com texts: MIT, Apache-2.0, BSD, GPL, LGPL, MPL-2.0, ISC,
Unlicense and 25 more) or, for the PSF licence that list lacks, by its title; a licence file neither names
is "unknown", and a repository without one has no licence (the code filters apply `licenses` only to
documents that have one, as for every source).
"""

from __future__ import annotations

import configparser
import glob
import os
import re
import urllib.parse
from collections.abc import Iterator
from typing import NamedTuple

from identify.identify import license_id
from pathspec import GitIgnoreSpec

UNKNOWN_LICENSE = "unknown"
LICENSE_STEMS = ("license", "licence", "copying.lesser", "copying", "unlicense")
"""Licence file names in the order they are tried: an LGPL project's COPYING holds the GPL it amends."""
LICENSE_SUFFIXES = ("", ".txt", ".md", ".rst")
MAX_LICENSE_BYTES = 256 * 1024  # the longest licence text identify knows (AGPL-3.0) is 34 KB
_PSF = re.compile(r"PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2", re.IGNORECASE)
_SCP_LIKE = re.compile(r"^(?:[^@/]+@)?[^/:]+:(?!//)")  # git@github.com:owner/name.git


class Repository(NamedTuple):
    root: str
    name: str
    license: str | None


class TreeFile(NamedTuple):
    """A file to read: `path` as found under the root (a followed link's own path), `relpath` from the root."""

    path: str
    relpath: str
    repo: str
    license: str | None
    size: int


class TreeReject(NamedTuple):
    path: str
    reason: str
    detail: str


class Ignored(NamedTuple):
    relpath: str
    directory: bool


def directories(pattern: str) -> list[str]:
    """The directories a local glob matches, sorted (a plain path matches itself)."""
    return sorted(p for p in glob.glob(pattern) if os.path.isdir(p))


def _git_dir(root: str) -> str | None:
    """`.git` itself, or where a `.git` file (a worktree, a submodule) points (`gitdir: ...`)."""
    dot_git = os.path.join(root, ".git")
    if os.path.isdir(dot_git):
        return dot_git
    try:
        with open(dot_git, encoding="utf-8") as handle:
            line = handle.readline().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not line.startswith("gitdir:"):
        return None
    git_dir = os.path.join(root, line.removeprefix("gitdir:").strip())
    try:  # a worktree keeps its config in the main repository's git dir
        with open(os.path.join(git_dir, "commondir"), encoding="utf-8") as handle:
            return os.path.join(git_dir, handle.read().strip())
    except (OSError, UnicodeDecodeError):
        return git_dir


def remote_url(root: str) -> str | None:
    """The url of remote `origin`, else of the first remote in `.git/config`; None without one."""
    git_dir = _git_dir(root)
    if git_dir is None:
        return None
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    try:
        with open(os.path.join(git_dir, "config"), encoding="utf-8") as handle:
            parser.read_file(handle)
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    remotes = [s for s in parser.sections() if s.startswith('remote "') and parser.has_option(s, "url")]
    remotes.sort(key=lambda s: s != 'remote "origin"')
    return parser.get(remotes[0], "url").strip() if remotes else None


def name_from_url(url: str) -> str | None:
    """`owner/name` of a remote url (https, ssh, scp-like `git@host:owner/name.git`; never its credentials),
    the last path part of a local one."""
    if "://" in url:
        path = urllib.parse.urlsplit(url).path
    elif _SCP_LIKE.match(url):
        path = url.split(":", 1)[1]
    else:
        parts = [p for p in url.replace("\\", "/").split("/") if p]
        return (parts[-1].removesuffix(".git") or None) if parts else None
    parts = [p for p in path.split("/") if p]
    if parts:
        parts[-1] = parts[-1].removesuffix(".git")
    parts = [p for p in parts if p]
    return "/".join(parts[-2:]) or None


def _license_files(root: str) -> list[str]:
    def rank(name: str) -> tuple[int, str] | None:
        lower = name.lower()
        for i, stem in enumerate(LICENSE_STEMS):
            if lower in (stem + suffix for suffix in LICENSE_SUFFIXES) or lower.startswith(stem + "-"):
                return i, name
        return None

    try:
        names = os.listdir(root)
    except OSError:
        return []
    ranked = sorted(r for r in map(rank, names) if r is not None)
    paths = [os.path.join(root, name) for _, name in ranked]
    return [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]  # a link may lead out of the tree


def _identify(path: str) -> str | None:
    try:
        if os.path.getsize(path) > MAX_LICENSE_BYTES:
            return None
        found = license_id(path)
        if found is not None:
            return found.lower()
        with open(path, encoding="utf-8") as handle:
            return "psf-2.0" if _PSF.search(handle.read()) else None
    except (OSError, UnicodeDecodeError):
        return None


def repository_license(root: str) -> str | None:
    """The SPDX id of the first licence file identified; "unknown" when none is; None without a licence file."""
    candidates = _license_files(root)
    for path in candidates:
        found = _identify(path)
        if found is not None:
            return found
    return UNKNOWN_LICENSE if candidates else None


def repository(root: str) -> Repository:
    root = os.path.abspath(root)
    url = remote_url(root)
    name = (name_from_url(url) if url else None) or os.path.basename(root.rstrip(os.sep)) or root
    return Repository(root, name, repository_license(root))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


Specs = tuple[tuple[str, GitIgnoreSpec], ...]


def _ignored(relpath: str, is_dir: bool, specs: Specs) -> bool:
    for base, spec in reversed(specs):
        below = relpath[len(base) + 1:] if base else relpath
        result = spec.check_file(below + "/" if is_dir else below)
        if result.include is not None:
            return bool(result.include)
    return False


class _Walk:
    """One repository's walk: the root's real path and the directory links already followed."""

    def __init__(self, repo: Repository):
        self.repo = repo
        self.real_root = os.path.realpath(repo.root)
        self.followed: set[str] = set()

    def directory(self, path: str, relpath: str, specs: Specs, ancestors: tuple[str, ...]) -> Iterator[TreeFile | TreeReject | Ignored]:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            yield TreeReject(path, "unreadable_directory", f"{relpath or '.'}: {exc.strerror or exc}")
            return
        if any(e.name == ".gitignore" and e.is_file(follow_symlinks=False) for e in entries):
            try:
                with open(os.path.join(path, ".gitignore"), encoding="utf-8", errors="replace") as handle:
                    specs = (*specs, (relpath, GitIgnoreSpec.from_lines(handle.read().splitlines())))
            except (OSError, ValueError) as exc:  # pathspec's pattern errors are ValueErrors
                yield TreeReject(os.path.join(path, ".gitignore"), "invalid_gitignore", f"{type(exc).__name__}: {exc}; its patterns are not applied")
        for entry in entries:
            if entry.name != ".git":
                yield from self.entry(entry, f"{relpath}/{entry.name}" if relpath else entry.name, specs, ancestors)

    def entry(self, entry: os.DirEntry, relpath: str, specs: Specs, ancestors: tuple[str, ...]) -> Iterator[TreeFile | TreeReject | Ignored]:
        link = entry.is_symlink()
        real = os.path.realpath(entry.path) if link else ""
        is_dir = os.path.isdir(real) if link else entry.is_dir(follow_symlinks=False)
        if _ignored(relpath, is_dir, specs):  # before the link checks: an ignored link is the user's to leave out
            yield Ignored(relpath, is_dir)
            return
        if link:
            written = os.readlink(entry.path)
            if not _within(real, self.real_root) or _within(real, os.path.join(self.real_root, ".git")):
                yield TreeReject(entry.path, "symlink_outside_root", f"link {relpath} -> {written} points outside the repository: not followed")
                return
            if not os.path.exists(real):
                yield TreeReject(entry.path, "broken_symlink", f"link {relpath} -> {written}: no such file")
                return
        if is_dir:
            if link and real in ancestors:
                yield TreeReject(entry.path, "symlink_loop", f"link {relpath} -> {written} points to a directory containing it: not followed")
                return
            if link and real in self.followed:
                yield TreeReject(entry.path, "symlink_repeat", f"link {relpath} -> {written}: that directory was already walked through another link")
                return
            if link:
                self.followed.add(real)
            yield from self.directory(entry.path, relpath, specs, (*ancestors, real or os.path.realpath(entry.path)))
            return
        try:
            regular = entry.is_file(follow_symlinks=True)
            size = entry.stat(follow_symlinks=True).st_size
        except OSError as exc:
            yield TreeReject(entry.path, "unreadable_entry", f"{relpath}: {exc.strerror or exc}")
            return
        if not regular:
            yield TreeReject(entry.path, "not_a_regular_file", f"{relpath} is a device, socket or pipe")
            return
        yield TreeFile(entry.path, relpath, self.repo.name, self.repo.license, size)


def walk(root: str) -> Iterator[TreeFile | TreeReject | Ignored]:
    """Every path of the repository at `root`, in sorted order: a file to read, a reject, or an ignored path."""
    repo = repository(root)
    walk_ = _Walk(repo)
    yield from walk_.directory(repo.root, "", (), (walk_.real_root,))
