"""The docs are run, not trusted: every quickstart's ```bash blocks execute verbatim, the CLI reference is the
commands' current --help, and the site builds with `mkdocs build --strict`.

The rule a page follows (docs/CONTRIBUTING.md): a ```bash fence is run, any other fence (```sh, ```console,
```yaml, ...) is shown only. A ```text fence right after a ```bash fence is an excerpt of that block's output:
each of its lines other than `...` must appear in a line the block printed (stdout and stderr), where "..."
inside a line matches any text. Each block runs on its own in `bash -euo pipefail` from a scratch stand-in for
the repo root (its top-level entries linked, so `.venv/bin/...` works as in a checkout), where the pages write
only under `quickstart/`. A page's `<!-- docs-test: after corpus.md -->` runs that page first, in the same
scratch root; `<!-- docs-test: services slurm -->` starts the named services (conftest's fixtures) first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.conftest import locked, run_shared_dir

REPO = Path(__file__).resolve().parents[1]
QUICKSTARTS = REPO / "docs" / "quickstart"
OUTPUTS = "quickstart"
"""The one top-level directory a page may write: `.gitignore` lists it, the harness checks nothing else appears."""
BLOCK_TIMEOUT_S = 300
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(after|services)\s+(.+?)\s*-->")


@dataclass
class Block:
    code: str
    line: int
    expect: list[str] = field(default_factory=list)


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    after: list[str]
    services: list[str]


def parse_page(path: Path, text: str | None = None) -> Page:
    """The run blocks of a quickstart, each with the output excerpt that follows it, and its directives."""
    text = path.read_text() if text is None else text
    blocks: list[Block] = []
    previous_was_run = False
    for token in MarkdownIt().parse(text):
        if token.type != "fence":
            continue
        info = token.info.strip()
        if info == "bash":
            blocks.append(Block(token.content, token.map[0] + 1 if token.map else 0))
        elif info == "text" and previous_was_run:
            blocks[-1].expect = [line.strip() for line in token.content.splitlines() if line.strip() not in ("", "...")]
        previous_was_run = info == "bash"
    directives = DIRECTIVE.findall(text)
    return Page(
        path, blocks,
        after=[name for kind, names in directives if kind == "after" for name in names.split()],
        services=[name for kind, names in directives if kind == "services" for name in names.split()],
    )


def shown_in(line: str, output: str) -> bool:
    """Whether one line of the output holds `line`, where each "..." in it stands for any text."""
    pattern = ".*".join(re.escape(part) for part in line.split("..."))
    return re.search(pattern, output) is not None


def scratch_root(directory: Path) -> Path:
    """A stand-in for the repo root: every top-level entry linked (the venv too), the pages' outputs real files."""
    for entry in REPO.iterdir():
        if entry.name not in (OUTPUTS, ".git"):
            (directory / entry.name).symlink_to(entry)
    return directory


def run_page(page: Page, root: Path) -> list[str]:
    """Each block in order; the problems found (empty: the page works as written)."""
    problems = []
    for block in page.blocks:
        where = f"{page.path.name}:{block.line}"
        try:
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.code], cwd=root, capture_output=True, text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return [*problems, f"{where}: did not finish in {BLOCK_TIMEOUT_S} s:\n{block.code}"]
        output = result.stdout + result.stderr
        if result.returncode != 0:
            return [*problems, f"{where}: exit {result.returncode}:\n{block.code}\n--- output ---\n{output[-4000:]}"]
        missing = [line for line in block.expect if not shown_in(line, output)]
        if missing:
            problems.append(f"{where}: the page shows {missing} but the block printed:\n{output[-4000:]}")
    return problems


class Site:
    """One scratch root per test run, shared by its xdist workers; each page runs at most once in it, its `after`
    pages first. Why shared: the Slurm page runs on the slurm group's worker, and a root of its own would run its
    `after` page (corpus.md, ~50 s) a second time. A page's outcome is a file, written under the page's lock."""

    def __init__(self, root: Path, outcomes: Path):
        self.root = root
        self.outcomes = outcomes

    def run(self, name: str, request: pytest.FixtureRequest) -> list[str]:
        outcome = self.outcomes / f"{name}.json"
        with locked(self.outcomes / f"{name}.lock"):
            if not outcome.exists():
                page = parse_page(QUICKSTARTS / name)
                for before in page.after:
                    if problems := self.run(before, request):
                        return [f"{name} needs {before}, which failed:", *problems]
                for service in page.services:
                    request.getfixturevalue(service)
                outcome.write_text(json.dumps(run_page(page, self.root)))
            return json.loads(outcome.read_text())


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    shared = run_shared_dir(tmp_path_factory)
    root, outcomes = shared / "docs-root", shared / "docs-outcomes"
    with locked(shared / "docs-site.lock"):
        if not root.exists():
            outcomes.mkdir()
            root.mkdir()
            scratch_root(root)
    return Site(root, outcomes)


def pages(on_slurm: bool) -> list[str]:
    """The pages that submit Slurm jobs (they join conftest's slurm group), or the others."""
    return [p.name for p in sorted(QUICKSTARTS.glob("*.md")) if ("slurm" in parse_page(p).services) == on_slurm]


@pytest.mark.xdist_group("docs")
@pytest.mark.parametrize("name", pages(on_slurm=False))
def test_a_quickstart_runs_as_written(name, site, request):
    top = set(p.name for p in site.root.iterdir())
    assert not (problems := site.run(name, request)), "\n".join(problems)
    assert set(p.name for p in site.root.iterdir()) <= top | {OUTPUTS}, "a page wrote outside quickstart/"


@pytest.mark.parametrize("name", pages(on_slurm=True))
def test_a_quickstart_on_local_services_runs_as_written(name, site, request, slurm):
    """Pages on Slurm join conftest's slurm group (the `slurm` fixture) so their job is the node's only one."""
    assert not (problems := site.run(name, request)), "\n".join(problems)


def test_every_quickstart_has_a_run_block_and_is_in_the_site_nav_or_held_back():
    """A page not ready for readers yet stays out of the nav by name, in mkdocs.yml's `not_in_nav`; it is still run."""
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    listed = set(re.findall(r"quickstart/[\w-]+\.md", str(config["nav"])))
    held_back = set(re.findall(r"quickstart/[\w-]+\.md", str(config["not_in_nav"] or "")))
    pages_here = {f"quickstart/{path.name}" for path in QUICKSTARTS.glob("*.md")}
    assert listed and listed | held_back == pages_here, (
        f"mkdocs.yml lists {sorted(listed | held_back)} (nav, not_in_nav); docs/ holds {sorted(pages_here)}")
    for path in sorted(QUICKSTARTS.glob("*.md")):
        assert parse_page(path).blocks, f"{path.name} has no ```bash block: nothing of it is tested"


PAGE = """# demo
<!-- docs-test: after corpus.md -->
```bash
echo hello; echo world >&2
```

```text
hello
...
world
```

```sh
exit 1
```

```bash
.venv/bin/ember corpus no-such-command
```
"""


def test_the_harness_runs_bash_fences_checks_their_output_and_fails_on_a_drifted_command(tmp_path):
    page = parse_page(tmp_path / "demo.md", PAGE)
    assert [b.code for b in page.blocks] == ["echo hello; echo world >&2\n", ".venv/bin/ember corpus no-such-command\n"]
    assert page.blocks[0].expect == ["hello", "world"] and page.after == ["corpus.md"]
    (tmp_path / "root").mkdir()
    root = scratch_root(tmp_path / "root")
    problems = run_page(page, root)
    assert len(problems) == 1 and "demo.md:17: exit 2" in problems[0] and "No such command" in problems[0]
    page.blocks[0].expect = ["hello", "goodbye"]
    assert "the page shows ['goodbye']" in run_page(page, root)[0]


def test_the_cli_reference_is_the_commands_current_help():
    result = subprocess.run([sys.executable, str(REPO / "docs" / "gen_cli_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Hostile and broken input" in (tmp_path / "site" / "guarantees" / "index.html").read_text()
    assert (tmp_path / "site" / "quickstart" / "corpus" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
