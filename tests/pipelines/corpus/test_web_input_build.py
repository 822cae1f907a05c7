"""A corpus build from WARC archives on FnApiRunner: extraction, the URL block-list, language ID and its
allow-list, a cut archive, and the per-language counts of report.md and report.html."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ember.pipelines.corpus.config import load_config
from ember.pipelines.corpus.report import read_stats, render_report
from ember.pipelines.corpus.report_html import collect, render_html

from tests.pipelines.corpus_support import build, rows
from tests.pipelines.web_support import PROSE, Record, page, warc_bytes

PAGES = [
    Record("https://news.example.org/river", page("River", [PROSE["en"]])),
    Record("https://blog.example.org/town", page("Town", [PROSE["en"].replace("river", "canal"), PROSE["en"][:120]])),
    Record("https://www.example.de/fluss", page("Fluss", [PROSE["de"]])),
    Record("https://www.example.fr/riviere", page("Rivière", [PROSE["fr"]])),
    Record("https://cdn.ads.blocked.test/en", page("Ad", [PROSE["en"].replace("boats", "ships")])),
    Record("https://spam.test/es", page("Río", [PROSE["es"]])),
    Record("https://www.example.org/paper.pdf", b"%PDF-1.4", content_type="application/pdf"),
]
CODE = [
    {"content": "def area(radius):\n    return 3.14159 * radius * radius\n", "path": "geometry/area.py"},
    {"content": "package main\n\nfunc Area(r float64) float64 {\n\treturn 3.14159 * r * r\n}\n", "path": "geo/area.go"},
]


def test_warc_build_filters_by_url_and_language_and_reports_languages(tmp_path: Path) -> None:
    inputs = tmp_path / "crawl"
    inputs.mkdir()
    (inputs / "a.warc.gz").write_bytes(warc_bytes(PAGES[:4], gzip=True))
    rest = warc_bytes(PAGES[4:], gzip=False)
    (inputs / "b.warc").write_bytes(rest + warc_bytes([Record("https://example.org/cut", page("Cut", [PROSE["en"]]))], False)[:300])
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CODE))
    (tmp_path / "blocked.txt").write_text("# ad networks\nblocked.test\n")
    off = {"enabled": False}
    config = {
        "sources": [
            {"name": "cc", "kind": "web", "inputs": ["crawl/*.warc*"], "format": "warc", "html": {"time_limit_s": 10}},
            {"name": "code", "kind": "code", "inputs": ["code.jsonl"],
             "fields": {"text": "content", "metadata": {"path": "path"}}},
        ],
        "filters": {"web": {
            "url_blocklist": {"file": "blocked.txt", "domains": ["spam.test"]},
            "languages": ["en", "de"],
            "gopher_repetition": off, "gopher_quality": off, "c4_quality": off, "fineweb_quality": off,
        }},
        "dedup": {"exact": False, "near": False},
        "output": {"directory": "out"},
    }
    (tmp_path / "build.yaml").write_text(yaml.safe_dump(config))
    assert build(load_config(str(tmp_path / "build.yaml"))) == "DONE"
    out = tmp_path / "out"

    docs = {d["metadata"]["url"] or d["metadata"]["path"]: d for d in rows(out, "documents")}
    assert sorted(docs) == ["geo/area.go", "geometry/area.py", "https://blog.example.org/town",
                            "https://news.example.org/river", "https://www.example.de/fluss"]
    river = docs["https://news.example.org/river"]["metadata"]
    assert (river["language"], river["content_type"]) == ("en", "text/html") and river["language_score"] > 0.9
    assert river["fetch_date"] and docs["https://www.example.de/fluss"]["metadata"]["language"] == "de"
    assert docs["geo/area.go"]["metadata"]["language"] == "go" and docs["geo/area.go"]["metadata"]["language_score"] is None

    rejects = {(r["stage"], r["reason"]): r for r in rows(out, "rejects")}
    assert sorted(rejects) == [("filter", "language:fr"), ("filter", "url_blocklist:blocked.test"),
                               ("filter", "url_blocklist:spam.test"), ("read", "not_html:application/pdf"),
                               ("read", "unreadable_file")]
    assert rejects[("read", "unreadable_file")]["location"] == f"{inputs / 'b.warc'}:record=4"

    stats = read_stats(str(out))
    assert stats["totals"]["balanced"] and stats["totals"]["docs_in"] == 10
    assert stats["sources"]["cc"]["stages"]["read"]["files_unreadable"] == 1

    report = render_report(str(out))
    web_table = report.split("Web languages (language ID, ISO 639-1):")[1]
    assert "| en | 2 | 1.000 |" in web_table and "| de | 1 | 1.000 |" in web_table
    code_table = report.split("Code languages (programming language per document):")[1].split("Web languages")[0]
    assert "| go | 1 |" in code_table and "| python | 1 |" in code_table
    html = render_html(collect(str(out)))
    languages = html.split("<h2>Languages</h2>")[1].split("<h2>")[0]
    assert "<td>web</td><td>en</td><td>2</td>" in languages and "<td>code</td><td>python</td><td>1</td>" in languages
