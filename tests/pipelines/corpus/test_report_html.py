"""report.html: the aggregates behind its charts (hand-built outputs), and a real build's page drawn by
headless Chromium with the network cut off, so every chart must come from the page itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.cli import app
from ember.pipelines.corpus.build import BuildOutcome, build_corpus
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.report_html import (
    NOT_RECORDED, bin_label, cluster_sizes, collect, document_mix, figures, funnel, length_bin, length_bins,
    redactions_by_source, rejects_by_source, render_html, token_lengths,
)
from ember.pipelines.corpus.stages import size_bin
from ember.schemas.documents import CLUSTER_SCHEMA, Document, documents_to_table
from ember.schemas.shards import Manifest, SourceStats, TokenizerIdentity, read_manifest, write_manifest
from ember.tokenize.packing import PackedRow
from ember.tokenize.shards import ShardRow, write_shard

ALL_CHARTS = ["funnel", "rejects", "char_lengths", "token_lengths", "clusters", "redactions", "languages", "licences"]


def test_length_bins_are_log2_and_agree_with_the_scalar_rule() -> None:
    values = [0, 1, 2, 3, 4, 7, 8, 1023, 1024, 1025] + [2**k + d for k in range(11, 62) for d in (-1, 0, 1)]
    assert list(length_bins(np.array(values))) == [length_bin(v) for v in values]
    assert [length_bin(v) for v in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 1, 2, 2, 3, 10, 11]
    assert [bin_label(b) for b in (0, 1, 2, 11)] == ["0", "1-1", "2-3", "1,024-2,047"]


def hand_stats() -> dict:
    """Two sources: `web` loses 3 at read (2 bad lines, 1 duplicate id), 2 filtered, 1 exact dup, 1 near dup."""
    return {
        "totals": {"docs_in": 15, "bytes_in": 0, "kept": 7, "bytes_kept": 0, "rejected": 8, "balanced": True,
                   "rejected_by_reason": {}, "redactions": {"email": 2, "password": 1}},
        "sources": {
            "web": {"kind": "web", "weight": 1.0, "docs_in": 10, "kept": 3, "bytes_kept": 0, "redactions": {"email": 2},
                    "rejected": {"read:invalid_json": 2, "unique_ids:duplicate_id": 1, "filter:too_short": 2,
                                 "exact_dedup:exact_duplicate": 1, "near_dedup:near_duplicate": 1},
                    "stages": {}},
            "code": {"kind": "code", "weight": 1.0, "docs_in": 5, "kept": 4, "bytes_kept": 0,
                     "redactions": {"email": 1, "password": 1}, "rejected": {"filter:too_short": 1}, "stages": {}},
        },
        "dedup": {stage: {"clusters": 1, "removed": 1, "cluster_sizes": {"2": 1}} for stage in ("exact_dedup", "near_dedup")},
    }


def test_funnel_rejects_and_redactions_from_stats() -> None:
    stats = hand_stats()
    assert funnel(stats) == {
        "web": [("in", 10), ("read", 7), ("filtered", 5), ("redacted", 5), ("exact dedup", 4), ("near dedup", 3),
                ("written", 3)],
        "code": [("in", 5), ("read", 5), ("filtered", 4), ("redacted", 4), ("exact dedup", 4), ("near dedup", 4),
                 ("written", 4)],
    }
    rejects = rejects_by_source(stats)
    assert list(rejects)[:2] == ["filter:too_short", "read:invalid_json"], "largest total first, then by name"
    assert rejects["filter:too_short"] == {"web": 2, "code": 1}
    assert redactions_by_source(stats) == {"email": {"web": 2, "code": 1}, "password": {"code": 1}}


def write_hand_outputs(directory: Path) -> None:
    """Kept documents of known lengths and metadata in two Parquet parts of small row groups, and clusters."""
    web = [Document("web", "web", "w" * n, {"url": f"https://example.org/{n}"}) for n in (1, 3, 3, 100)]
    code = [Document("code", "code", "c" * n, {"language": lang, "license": lic})
            for n, lang, lic in ((4, "python", "mit"), (7, "python", None), (1024, "go", "mit"))]
    for source, documents in (("web", web), ("code", code)):
        (directory / "documents" / source).mkdir(parents=True)
        pq.write_table(documents_to_table(documents), directory / "documents" / source / "part-00000-of-00001.parquet",
                       row_group_size=2)
    (directory / "clusters").mkdir()
    members = [("near_dedup", "a", 3), ("near_dedup", "b", 2), ("near_dedup", "c", 2), ("exact_dedup", "d", 2)]
    rows = [{"document_id": f"{cid}{i}", "source": "web", "location": "x", "stage": stage, "cluster_id": cid, "kept": i == 0}
            for stage, cid, size in members for i in range(size)]
    for part, half in enumerate((rows[::2], rows[1::2])):  # a cluster's members spread over both parts
        pq.write_table(pa.Table.from_pylist(half, schema=CLUSTER_SCHEMA), directory / "clusters" / f"part-{part}.parquet")
    (directory / "stats.json").write_text(json.dumps(hand_stats()))


def test_document_and_cluster_aggregates_from_hand_built_parquet(tmp_path: Path) -> None:
    write_hand_outputs(tmp_path)
    mix = document_mix(str(tmp_path))
    assert mix.char_bins == Counter({("web", 1): 1, ("web", 2): 2, ("web", 7): 1, ("code", 3): 2, ("code", 11): 1})
    assert mix.languages == Counter({("web", NOT_RECORDED): 4, ("code", "python"): 2, ("code", "go"): 1})
    assert mix.licences == Counter({("code", "mit"): 2, ("code", NOT_RECORDED): 1}), "licences count code only"
    assert mix.kind_languages == Counter({("web", NOT_RECORDED): 4, ("code", "python"): 2, ("code", "go"): 1})
    assert cluster_sizes(str(tmp_path)) == Counter({("near_dedup", 3): 1, ("near_dedup", 2): 2, ("exact_dedup", 2): 1})
    data = collect(str(tmp_path))
    assert data.tokens is None and "no token counts" in render_html(data, "hand.yaml")
    assert list(figures(data)) == [c for c in ALL_CHARTS if c != "token_lengths"]


def test_token_lengths_sum_a_split_document_over_rows_and_shards(tmp_path: Path) -> None:
    def row(segments: list[tuple[str, int, int]], seq_len: int = 8) -> PackedRow:
        cu = np.cumsum([0] + [end - start for _, start, end in segments]).astype(np.int32)
        segs = [{"document_id": d, "doc_token_start": s, "doc_token_end": e} for d, s, e in segments]
        return PackedRow(np.zeros(seq_len, dtype=np.uint32), cu, segs)

    # doc "a" (11 tokens) is split over two rows in two shards; "b" has 3 tokens, "c" 8, "d" 1.
    shard0 = [ShardRow(row([("a", 0, 8)]), "web"), ShardRow(row([("b", 0, 3), ("d", 0, 1)]), "web")]
    shard1 = [ShardRow(row([("a", 8, 11)]), "web"), ShardRow(row([("c", 0, 8)]), "code")]
    entries = [write_shard(tmp_path, i, rows, rows_per_batch=1) for i, rows in enumerate((shard0, shard1))]
    write_manifest(tmp_path, Manifest(
        tokenizer=TokenizerIdentity(name="t", hash="0" * 16, vocab_size=10), seq_len=8, dtype="uint16",
        sources={"web": SourceStats(documents=3, tokens=15, sequences=3, padding_tokens=9),
                 "code": SourceStats(documents=1, tokens=8, sequences=1, padding_tokens=0)},
        padding_tokens=9, pad_token_id=0, shards=entries, config_hash="0" * 16, created_at="now",
    ))
    assert token_lengths(tmp_path) == Counter({("web", 4): 1, ("web", 2): 1, ("web", 1): 1, ("code", 4): 1})


# ---------------------------------------------------------------- a real build, drawn by Chromium --

@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("report-input"))


@pytest.fixture(scope="module")
def built(sample: SampleCorpus, hf_tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildOutcome]:
    """One build with a tokenize stage, through `build_corpus` as `ember corpus build` runs it."""
    out = tmp_path_factory.mktemp("report-out")
    config = {**sample.config(str(out)), "tokenize": {
        "seq_len": 128, "window_documents": 8, "sequences_per_shard": 4, "rows_per_batch": 2, "seed": 3,
        "tokenizer": {"kind": "huggingface", "path": str(hf_tokenizer_path), "eos_token": "<|endoftext|>",
                      "pad_token": "<|pad|>"},
    }}
    return out, build_corpus(parse_config(config), ["--runner=FnApiRunner"], config_path="configs/sample corpus.yaml")


def test_aggregates_agree_with_the_builds_own_counts(built: tuple[Path, BuildOutcome]) -> None:
    out, outcome = built
    stats = outcome.stats
    data = collect(str(out), str(out / "shards"))
    for name, steps in funnel(stats).items():
        stages, left = stats["sources"][name]["stages"], dict(steps)
        unique_id_rejects = sum(stages.get("unique_ids", {}).get("rejected", {}).values())
        assert left["read"] == stages["read"]["docs_out"] - unique_id_rejects
        assert (left["filtered"], left["exact dedup"], left["written"]) == (
            stages["filter"]["docs_out"], stages["exact_dedup"]["docs_out"], stages["output"]["docs_out"])
        assert left["near dedup"] == left["written"]
        assert sum(n for (s, _), n in data.mix.char_bins.items() if s == name) == stats["sources"][name]["kept"]
    manifest = read_manifest(out / "shards")
    assert data.tokens and {name: s.documents for name, s in manifest.sources.items()} == {
        name: sum(n for (s, _), n in data.tokens.items() if s == name) for name in manifest.sources}
    for stage, d in stats["dedup"].items():
        binned: Counter[str] = Counter()
        for (s, size), n in data.clusters.items():
            if s == stage:
                binned[size_bin(size)] += n
        assert binned == Counter(d["cluster_sizes"]) and sum(binned.values()) == d["clusters"]


class Charts(HTMLParser):
    """Chart containers (by id), drawn plots, plotly's SVG layers and every script `src` of a page."""

    def __init__(self, page: str):
        super().__init__()
        self.containers: list[str] = []
        self.drawn: list[str] = []
        self.svgs = 0
        self.script_sources: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if "plotly-graph-div" in classes:
            self.containers.append(attributes.get("id") or "")
        if "js-plotly-plot" in classes:
            self.drawn.append(attributes.get("id") or "")
        if tag == "svg" and "main-svg" in classes:
            self.svgs += 1
        if tag == "script" and attributes.get("src"):
            self.script_sources.append(attributes["src"])


def chromium_dom(page: Path) -> str:
    """The DOM after scripts ran, from headless Chromium with every network request failing."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed: this test renders report.html in headless Chromium. "
                    "Install Debian's package (`apt-get install chromium`; infra/test.sh does it when run as root).")
    result = subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1000,3000",
         "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--virtual-time-budget=30000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0 and "</html>" in result.stdout, f"chromium failed ({result.returncode}):\n{result.stderr[-3000:]}"
    return result.stdout


def test_build_writes_a_self_contained_report_whose_charts_draw_offline(built: tuple[Path, BuildOutcome]) -> None:
    out, outcome = built
    page_path = out / "report.html"
    assert page_path.parent == Path(outcome.report).parent and (out / "report.md").is_file()
    page = page_path.read_text()
    raw = Charts(page)
    assert raw.containers == [f"chart-{c}" for c in ALL_CHARTS] and raw.drawn == [] and raw.script_sources == []
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=[\"']?https?://", page, re.I)
    assert page.count("plotly.js v") == 1, "plotly.js is inlined exactly once"
    assert "configs/sample corpus.yaml" in page and "when stats.json was written" in page
    assert "Token lengths of the documents in the shard set" in page
    dom = Charts(chromium_dom(page_path))
    assert dom.drawn == raw.containers, "every chart container became a drawn plotly plot"
    assert dom.svgs >= 2 * len(ALL_CHARTS), "plotly draws a main and an overlay SVG per chart"


def test_report_command_rewrites_the_page_with_the_default_shard_set(built: tuple[Path, BuildOutcome]) -> None:
    out, _ = built
    (out / "report.html").unlink()
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    assert Charts(page).containers == [f"chart-{c}" for c in ALL_CHARTS] and "config: <code>not recorded" in page
