"""Repository-level documents: dependency order with import cycles, and spans that map back to the files."""

import itertools

from ember.pipelines.code.dependency_order import dependencies, dependency_order
from ember.pipelines.code.repos import RepoFile, render

# a -> b -> c -> a is a cycle; d needs a; e stands alone; lib/util in JavaScript; a Go package and C headers.
REPO = {
    "pkg/__init__.py": "",
    "pkg/a.py": "from pkg import b\nimport os\n",
    "pkg/b.py": "from . import c\n",
    "pkg/c.py": "import pkg.a\n",
    "pkg/d.py": "from .a import thing\n",
    "e.py": "print('alone')\n",
    "web/util.js": "import { q } from './lib';\n",
    "web/lib.js": "export const q = 1;\n",
    "go/main.go": 'package main\nimport (\n  "fmt"\n  "example.com/m/go/store"\n)\n',
    "go/store/store.go": "package store\n",
    "c/main.c": '#include "util.h"\n#include <stdio.h>\n',
    "c/util.h": "int f(void);\n",
    "java/com/x/App.java": "package com.x;\nimport com.x.model.User;\n",
    "java/com/x/model/User.java": "package com.x.model;\n",
    "README.md": "see pkg/a.py\n",
}


def test_imports_resolve_to_repository_files_per_language():
    deps = dependencies(REPO)
    assert deps["pkg/a.py"] == {"pkg/b.py"}  # `from pkg import b` names the module; os is not in the repository
    assert deps["pkg/b.py"] == {"pkg/c.py"}
    assert deps["pkg/d.py"] == {"pkg/a.py"}
    assert deps["web/util.js"] == {"web/lib.js"}
    assert deps["go/main.go"] == {"go/store/store.go"}  # fmt is not in the repository
    assert deps["c/main.c"] == {"c/util.h"}  # <stdio.h> is not either
    assert deps["java/com/x/App.java"] == {"java/com/x/model/User.java"}
    assert deps["README.md"] == set() and deps["e.py"] == set()


def test_cycle_is_broken_by_lowest_in_degree_and_every_file_appears_once():
    order = dependency_order(REPO)
    assert sorted(order) == sorted(REPO)
    at = {p: i for i, p in enumerate(order)}
    for dep, dependent in [("web/lib.js", "web/util.js"), ("go/store/store.go", "go/main.go"), ("c/util.h", "c/main.c"),
                           ("java/com/x/model/User.java", "java/com/x/App.java"), ("pkg/a.py", "pkg/d.py")]:
        assert at[dep] < at[dependent]
    # the cycle a -> b -> c -> a: each waits on one file, so the tie goes to the smallest path (a); then c (it
    # imports a) and b (it imports c) follow in dependency order
    cycle = [p for p in order if p in ("pkg/a.py", "pkg/b.py", "pkg/c.py")]
    assert cycle == ["pkg/a.py", "pkg/c.py", "pkg/b.py"]


def test_order_does_not_depend_on_input_order():
    orders = {tuple(dependency_order(dict(perm))) for perm in itertools.islice(itertools.permutations(REPO.items()), 0, 720, 97)}
    assert len(orders) == 1


def test_repository_document_spans_map_back_to_file_ids():
    files = [RepoFile(f"src:{p}", p, t) for p, t in REPO.items()]
    doc = render("src", "me/repo", files)
    assert doc.text.startswith("<repo_name>me/repo<file_sep>")
    assert [s.document_id for s in doc.spans] == [f"src:{p}" for p in dependency_order(REPO)]
    for span in doc.spans:
        path = span.document_id.removeprefix("src:")
        assert doc.text[span.start:span.end] == REPO[path]
        assert doc.text[:span.start].endswith(f"<file_sep>{path}\n")
        if span.end > span.start:
            assert doc.locate(span.start) == (span.document_id, 0)
    assert doc.locate(0) is None  # the repository header is framing
    assert "".join(text for _, text in doc.parts()) == doc.text
    shuffled = render("src", "me/repo", files, order="random", seed=3)
    assert shuffled == render("src", "me/repo", list(reversed(files)), order="random", seed=3)
    assert sorted(s.document_id for s in shuffled.spans) == sorted(s.document_id for s in doc.spans)


def test_cycle_breaks_at_the_file_with_fewest_unplaced_imports():
    # a imports b and c, b and c import a: a waits on two, b and c on one: b (smaller path of the two) goes first
    repo = {"a.py": "import b\nimport c\n", "b.py": "import a\n", "c.py": "import a\n"}
    assert dependency_order(repo) == ["b.py", "a.py", "c.py"]


def test_a_python_file_that_does_not_parse_still_has_its_imports():
    repo = {"a.py": "from pkg import b, c as see\nimport util\ndef broken(:\n", "pkg/b.py": "", "pkg/c.py": "", "util.py": "print 'py2'\n"}
    assert dependencies(repo)["a.py"] == {"pkg/b.py", "pkg/c.py", "util.py"}
