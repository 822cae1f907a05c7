"""`format: files`: source trees read directly, one document per file, with the repository's name, path,
language and licence; .gitignore'd files counted, binary files and links out of the tree rejected."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from identify.vendor.licenses import LICENSES

from ember.configs import CorpusConfigError
from ember.pipelines.corpus import trees
from ember.pipelines.corpus.config import CorpusSource, check_inputs, load_config, parse_config
from ember.pipelines.corpus.formats import read_file
from ember.pipelines.corpus.report import read_stats, render_report
from ember.pipelines.corpus.trees import TreeFile, TreeReject

from tests.pipelines.corpus_support import build, rows

TEXTS = dict(LICENSES)
MIT = TEXTS["MIT"].replace("Copyright (c) [year] [fullname]", "Copyright (c) 2021-2024 Acme Corp. and contributors")
PSF = """PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2
--------------------------------------------

1. This LICENSE AGREEMENT is between the Python Software Foundation ("PSF"), and
   the Individual or Organization ("Licensee") accessing and otherwise using this
   software ("Python") in source or binary form and its associated documentation.
"""
CODE = "def area(radius):\n    '''Area of a circle.'''\n    return 3.14159 * radius * radius\n"
GO = "package geo\n\n// Area of a circle.\nfunc Area(r float64) float64 {\n\treturn 3.14159 * r * r\n}\n"
GIT = shutil.which("git")


def _git(repo: Path, *args: str) -> None:
    assert GIT is not None, "git is not on PATH: the source-tree tests make real checkouts (ember itself is cloned with git)"
    subprocess.run(["git", "-c", "user.name=ember", "-c", "user.email=ember@example.org", "-c", "init.defaultBranch=main",
                    *args], cwd=repo, check=True, capture_output=True)


def make_trees(tmp_path: Path) -> Path:
    """repos/alpha: a git checkout (MIT, nested .gitignore, a binary file, links out, into a loop, to a file);
    repos/beta: a hand-written .git/config with an scp-like remote, GPL-3.0; outside.py: beside the repos."""
    (tmp_path / "outside.py").write_text(CODE)
    alpha = tmp_path / "repos" / "alpha"
    (alpha / "src" / "geo").mkdir(parents=True)
    (alpha / "build").mkdir()
    (alpha / "LICENSE").write_text(MIT)
    (alpha / ".gitignore").write_text("# build outputs\n*.log\nbuild/\n")
    (alpha / "src" / ".gitignore").write_text("!keep.log\nsecret_*.py\n")
    (alpha / "src" / "area.py").write_text(CODE)
    (alpha / "src" / "geo" / "area.go").write_text(GO)
    (alpha / "src" / "keep.log").write_text("kept: the nested .gitignore re-includes this log file\n")
    (alpha / "src" / "debug.log").write_text("ignored by the root .gitignore\n")
    (alpha / "src" / "secret_keys.py").write_text("ignored by the nested .gitignore = True\n")
    (alpha / "build" / "out.py").write_text(CODE)
    (alpha / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (alpha / "notes_latin1.txt").write_bytes("caf\xe9 cr\xe8me, a note in Latin-1 and not UTF-8\n".encode("latin-1"))
    os.symlink("../../outside.py", alpha / "escape.py")
    os.symlink("..", alpha / "src" / "up")
    os.symlink("src/area.py", alpha / "area_link.py")
    _git(alpha, "init", "-q")
    _git(alpha, "remote", "add", "origin", "https://someone:ghp_secret@github.com/acme/alpha.git")
    _git(alpha, "add", "-A")
    _git(alpha, "commit", "-q", "-m", "init")
    beta = tmp_path / "repos" / "beta"
    (beta / ".git").mkdir(parents=True)
    (beta / ".git" / "config").write_text(
        '[core]\n\trepositoryformatversion = 0\n[remote "upstream"]\n\turl = https://example.org/x/y.git\n'
        '\tfetch = +refs/heads/*:refs/remotes/upstream/*\n[remote "origin"]\n\turl = git@gitlab.com:geo-team/beta.git\n'
    )
    (beta / "COPYING").write_text(TEXTS["GPL-3.0"])
    (beta / "area.go").write_text(GO.replace("Area", "Surface"))
    return tmp_path / "repos"


def _walked(root: Path) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    files, rejects, ignored = [], [], []
    for item in trees.walk(str(root)):
        if isinstance(item, TreeFile):
            files.append(item.relpath)
        elif isinstance(item, TreeReject):
            rejects.append((os.path.relpath(item.path, root), item.reason))
        else:
            ignored.append(item.relpath + ("/" if item.directory else ""))
    return files, rejects, ignored


def test_walk_skips_git_and_ignored_paths_and_refuses_links_out_or_into_a_loop(tmp_path: Path) -> None:
    alpha = make_trees(tmp_path) / "alpha"
    files, rejects, ignored = _walked(alpha)
    assert files == [".gitignore", "LICENSE", "area_link.py", "logo.png", "notes_latin1.txt", "src/.gitignore",
                     "src/area.py", "src/geo/area.go", "src/keep.log"]
    assert rejects == [("escape.py", "symlink_outside_root"), ("src/up", "symlink_loop")]
    assert ignored == ["build/", "src/debug.log", "src/secret_keys.py"]
    assert _walked(alpha) == (files, rejects, ignored)  # sorted: the same tree lists the same way every time
    detail = next(r.detail for r in trees.walk(str(alpha)) if isinstance(r, TreeReject) and r.reason == "symlink_outside_root")
    assert detail == "link escape.py -> ../../outside.py points outside the repository: not followed"


def test_a_directory_link_inside_is_walked_once_and_a_second_link_to_it_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "a.py").write_text(CODE)
    os.symlink("lib", root / "m1")
    os.symlink("lib", root / "m2")
    os.symlink("nowhere.py", root / "dangling.py")
    os.symlink(".git/config", root / "gitconfig")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".gitignore").write_text("vendor\n")
    os.symlink(str(tmp_path), root / "vendor")  # out of the tree, but ignored: the user's to leave out
    files, rejects, ignored = _walked(root)
    assert files == [".gitignore", "lib/a.py", "m1/a.py"] and ignored == ["vendor/"]
    assert rejects == [("dangling.py", "broken_symlink"), ("gitconfig", "symlink_outside_root"), ("m2", "symlink_repeat")]
    (root / "lib" / ".gitignore").write_text("*.py\n!\n")  # a lone '!' is no pattern: the file is reported, not applied
    files, rejects, _ = _walked(root)
    assert "lib/a.py" in files and ("lib/.gitignore", "invalid_gitignore") in rejects


def test_repository_name_comes_from_the_remote_without_credentials(tmp_path: Path) -> None:
    repos = make_trees(tmp_path)
    assert trees.repository(str(repos / "alpha")).name == "acme/alpha"
    assert trees.repository(str(repos / "beta")).name == "geo-team/beta"  # origin before the first remote
    plain = tmp_path / "plain"
    plain.mkdir()
    assert trees.repository(str(plain)) == trees.Repository(str(plain), "plain", None)
    assert trees.name_from_url("ssh://git@host.example:2222/team/tool.git") == "team/tool"
    assert trees.name_from_url("/srv/git/tool.git") == "tool"
    assert trees.name_from_url("https://example.org/") is None


def test_a_worktree_reads_the_remote_of_its_main_repository(tmp_path: Path) -> None:
    main = tmp_path / "main"
    main.mkdir()
    (main / "a.py").write_text(CODE)
    _git(main, "init", "-q")
    _git(main, "remote", "add", "origin", "git@github.com:acme/tool.git")
    _git(main, "add", "-A")
    _git(main, "commit", "-q", "-m", "init")
    _git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    assert (tmp_path / "wt" / ".git").is_file()
    assert trees.repository(str(tmp_path / "wt")).name == "acme/tool"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"LICENSE": MIT}, "mit"),
        ({"LICENSE.txt": TEXTS["Apache-2.0"]}, "apache-2.0"),
        ({"LICENSE.md": TEXTS["BSD-3-Clause"]}, "bsd-3-clause"),
        ({"COPYING": TEXTS["GPL-3.0"], "COPYING.LESSER": TEXTS["LGPL-3.0"]}, "lgpl-3.0"),
        ({"LICENSE-MIT": MIT, "README.md": "# tool\n"}, "mit"),
        ({"LICENSE": PSF}, "psf-2.0"),
        ({"LICENSE": "All rights reserved. Do not copy.\n"}, "unknown"),
        ({"LICENSE": b"\xff\xfe not text"}, "unknown"),
        ({"README.md": "# no licence file\n"}, None),
    ],
)
def test_licence_is_the_spdx_id_of_the_licence_file(tmp_path: Path, files: dict[str, str | bytes], expected: str | None) -> None:
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    assert trees.repository_license(str(tmp_path)) == expected


def _source(**overrides) -> CorpusSource:
    return CorpusSource.model_validate({"name": "trees", "kind": "code", "inputs": ["repos/*"], "format": "files", **overrides})


def _read(path: Path, root: Path, size: int | None = None) -> tuple[dict | None, dict | None]:
    unit = TreeFile(str(path), str(path.relative_to(root)), "acme/alpha", "mit", path.stat().st_size if size is None else size)
    (result,) = list(read_file(unit, _source()))
    return result


def test_the_reader_makes_a_document_or_names_why_not(tmp_path: Path) -> None:
    alpha = make_trees(tmp_path) / "alpha"
    doc, _ = _read(alpha / "src" / "area.py", alpha)
    assert doc["id"] == "trees:acme/alpha/src/area.py" and doc["location"] == str(alpha / "src" / "area.py")
    assert doc["text"] == CODE and doc["kind"] == "code"
    assert {k: v for k, v in doc["metadata"].items() if v is not None} == {
        "repo": "acme/alpha", "path": "src/area.py", "license": "mit", "language": "python"}
    _, png = _read(alpha / "logo.png", alpha)
    assert (png["reason"], png["detail"]) == ("binary_file", "logo.png: NUL byte at offset 8")
    _, latin = _read(alpha / "notes_latin1.txt", alpha)
    assert latin["reason"] == "binary_file" and latin["detail"].startswith("notes_latin1.txt: not UTF-8 (byte 3:")
    _, grown = _read(alpha / "src" / "area.py", alpha, size=10)
    assert grown["reason"] == "file_too_large" and "grew past the 10 bytes" in grown["detail"]
    (alpha / "esc.py").write_text("x = '\x1b[0m'\n")
    _, control = _read(alpha / "esc.py", alpha)
    assert control["reason"] == "control_characters"


def test_config_refuses_what_a_files_source_cannot_do(tmp_path: Path) -> None:
    def problem(**overrides) -> str:
        with pytest.raises(CorpusConfigError) as caught:
            parse_config({"sources": [{"name": "t", "kind": "code", "inputs": ["repos/*"], "format": "files", **overrides}],
                          "output": {"directory": "out"}})
        return str(caught.value)

    assert "format files reads source trees: set kind: code" in problem(kind="web")
    assert "takes no fields mapping" in problem(fields={"text": "content"})
    assert "reads local directories" in problem(inputs=["gs://bucket/repos/*"]) and "gs://bucket/repos/*" in problem(
        inputs=["gs://bucket/repos/*"])
    (tmp_path / "only_a_file").write_text("x")
    config = parse_config({"sources": [{"name": "t", "kind": "code", "inputs": [str(tmp_path / "only_a_file")], "format": "files"}],
                           "output": {"directory": str(tmp_path / "out")}})
    with pytest.raises(CorpusConfigError, match=r"sources\.0\.inputs\.0: '.*only_a_file' matches no directory"):
        check_inputs(config)


def test_build_reads_two_repositories_with_metadata_rejects_and_balanced_counts(tmp_path: Path) -> None:
    make_trees(tmp_path)
    (tmp_path / "repos" / "beta" / "huge.py").write_text("x = 1\n" * 150)  # 900 bytes: over 4 x max_chars
    clone = tmp_path / "repos" / "alpha_copy"  # a second checkout of acme/alpha: its ids repeat alpha's
    (clone / ".git").mkdir(parents=True)
    (clone / ".git" / "config").write_text('[remote "origin"]\n\turl = git@github.com:acme/alpha\n')
    (clone / "src" / "geo").mkdir(parents=True)
    (clone / "src" / "geo" / "area.go").write_text(GO)
    config = {
        "sources": [{"name": "trees", "kind": "code", "inputs": ["repos/*"], "format": "files"}],
        "filters": {"code": {"max_chars": 200}},
        "dedup": {"exact": True, "near": False},
        "output": {"directory": "out"},
    }
    (tmp_path / "build.yaml").write_text(yaml.safe_dump(config))
    assert build(load_config(str(tmp_path / "build.yaml"))) == "DONE"
    out = tmp_path / "out"

    alpha, beta = tmp_path / "repos" / "alpha", tmp_path / "repos" / "beta"
    docs = {d["id"]: {k: v for k, v in d["metadata"].items() if v is not None} for d in rows(out, "documents")}
    mit = {"repo": "acme/alpha", "license": "mit"}
    assert docs == {
        "trees:acme/alpha/.gitignore": {**mit, "path": ".gitignore"},
        # src/area.py and this link to it hold the same text: exact dedup keeps the smaller id
        "trees:acme/alpha/area_link.py": {**mit, "path": "area_link.py", "language": "python"},
        "trees:acme/alpha/src/.gitignore": {**mit, "path": "src/.gitignore"},
        "trees:acme/alpha/src/geo/area.go": {**mit, "path": "src/geo/area.go", "language": "go"},
        "trees:acme/alpha/src/keep.log": {**mit, "path": "src/keep.log"},
    }
    rejects = sorted((r["location"], r["stage"], r["reason"]) for r in rows(out, "rejects"))
    assert rejects == sorted([
        (str(alpha / "LICENSE"), "read", "file_too_large"),
        (str(alpha / "escape.py"), "read", "symlink_outside_root"),
        (str(alpha / "logo.png"), "read", "binary_file"),
        (str(alpha / "notes_latin1.txt"), "read", "binary_file"),
        (str(alpha / "src" / "area.py"), "exact_dedup", "exact_duplicate"),
        (str(alpha / "src" / "up"), "read", "symlink_loop"),
        (str(beta / "COPYING"), "read", "file_too_large"),
        (str(beta / "area.go"), "filter", "license_not_allowed"),  # GPL-3.0: the default allow-list decides
        (str(beta / "huge.py"), "read", "file_too_large"),
        (str(clone / "src" / "geo" / "area.go"), "unique_ids", "duplicate_id"),  # same text: the first location keeps it
    ])
    assert all("ghp_secret" not in str(r) for r in rows(out, "rejects") + rows(out, "documents"))

    stats = read_stats(str(out))
    assert stats["totals"]["balanced"] and stats["totals"]["docs_in"] == 15
    read = stats["sources"]["trees"]["stages"]["read"]
    # files: those read (the three over the size cap were rejected unread)
    assert (read["repositories"], read["files"], read["files_ignored"], read["dirs_ignored"]) == (3, 10, 2, 1)
    assert "| read | symlink_outside_root | 1 |" in render_report(str(out))

    (tmp_path / "again.yaml").write_text(yaml.safe_dump({**config, "output": {"directory": "again"}}))
    assert build(load_config(str(tmp_path / "again.yaml"))) == "DONE"
    assert rows(tmp_path / "again", "documents") == rows(out, "documents")  # same tree: same ids, same order
