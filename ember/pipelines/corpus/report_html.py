"""report.html: a corpus build's report as one self-contained page of plotly charts, beside report.md.

plotly.js is inlined once in the page head and every chart is drawn from it, so the file opens offline
and nothing is fetched at view time. The numbers come from stats.json and from streamed passes over
only the needed columns of the outputs (text lengths per Parquet batch, clusters' stage and id, the
shard set's segment spans); no document text is held beyond one batch, and the page embeds only
aggregates (histogram bins, counts), so its size does not grow with the corpus.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs

from ember.pipelines.corpus.report import output_paths, read_stats, summary_rows
from ember.pipelines.quality.classifier import SCORE_BIN_PREFIX, SCORE_BINS
from ember.schemas.documents import REPORT_HTML_FILE, STATS_FILE
from ember.schemas.shards import MANIFEST_FILENAME, read_manifest

# Funnel steps after `in` (input units): each removes the documents its stages rejected. Unique-id
# rejects count with the read; stages without rejects leave the count unchanged.
FUNNEL_STEPS: tuple[tuple[str, frozenset[str]], ...] = (
    ("read", frozenset({"read", "unique_ids"})),
    ("filtered", frozenset({"filter"})),
    ("redacted", frozenset({"redact"})),
    ("decontaminated", frozenset({"decontaminate"})),
    ("exact dedup", frozenset({"exact_dedup"})),
    ("near dedup", frozenset({"near_dedup"})),
)
OPTIONAL_STEPS = frozenset({"decontaminated"})  # shown only when a build ran that stage
NOT_RECORDED = "(not recorded)"
DOCUMENT_COLUMNS = ["source", "kind", "text", "metadata.language", "metadata.license"]
# Text is read in batches of this many documents through a small read buffer, so memory follows the batch
# (~25 MB of Arrow memory on 4 kB documents), not the file or the corpus.
DOCUMENT_BATCH = 1024
CHART_CONFIG = {"responsive": True, "displaylogo": False}


def length_bin(n: int) -> int:
    """Log2 bin of a length: 0 holds 0, bin b >= 1 holds [2^(b-1), 2^b)."""
    return int(n).bit_length()


POWERS_OF_TWO = 1 << np.arange(63, dtype=np.int64)


def length_bins(lengths: np.ndarray) -> np.ndarray:
    """`length_bin` over an array, in integers (float log2 rounds up just below large powers of two)."""
    return np.searchsorted(POWERS_OF_TWO, np.asarray(lengths, dtype=np.int64), side="right")


def bin_label(b: int) -> str:
    return "0" if b == 0 else f"{2 ** (b - 1):,}-{2**b - 1:,}"


def funnel(stats: dict[str, Any]) -> dict[str, list[tuple[str, int]]]:
    """Per source, (step, documents left): `in`, each of FUNNEL_STEPS, then `written` (the kept documents)."""
    out = {}
    ran = {stage for source in stats["sources"].values() for stage in source["stages"]}
    for name, source in stats["sources"].items():
        removed: Counter[str] = Counter()
        for key, n in source["rejected"].items():
            removed[key.split(":", 1)[0]] += n
        left = source["docs_in"]
        steps = [("in", left)]
        for step, stages in FUNNEL_STEPS:
            if step in OPTIONAL_STEPS and not stages & ran:
                continue
            left -= sum(removed[s] for s in stages)
            steps.append((step, left))
        steps.append(("written", source["kept"]))
        out[name] = steps
    return out


def rejects_by_source(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """`stage:reason` -> source -> documents, the reasons ordered by total, largest first."""
    totals: Counter[str] = Counter()
    for source in stats["sources"].values():
        totals.update(source["rejected"])
    return {
        reason: {name: s["rejected"][reason] for name, s in stats["sources"].items() if s["rejected"].get(reason)}
        for reason, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))
    }


def quality_scores(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Score bin ("0.35-0.40") -> source -> documents the quality classifier scored there, kept or rejected;
    every bin between the lowest and highest reached is shown."""
    counts: dict[int, dict[str, int]] = {}
    for name, source in stats["sources"].items():
        for metric, n in source["stages"].get("quality_classifier", {}).items():
            if metric.startswith(SCORE_BIN_PREFIX):
                counts.setdefault(int(metric.removeprefix(SCORE_BIN_PREFIX)), {})[name] = n
    if not counts:
        return {}
    return {f"{b / SCORE_BINS:.2f}-{(b + 1) / SCORE_BINS:.2f}": counts.get(b, {}) for b in range(min(counts), max(counts) + 1)}


def redactions_by_source(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Redaction kind -> source -> placeholders inserted."""
    kinds = sorted({k for s in stats["sources"].values() for k in s["redactions"]})
    return {k: {name: s["redactions"][k] for name, s in stats["sources"].items() if s["redactions"].get(k)} for k in kinds}


@dataclass
class DocumentMix:
    """Kept documents, aggregated: (source, char-length bin), (source, language), (source, licence) of code."""

    char_bins: Counter[tuple[str, int]] = field(default_factory=Counter)
    languages: Counter[tuple[str, str]] = field(default_factory=Counter)
    kind_languages: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, language): code and web apart
    licences: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, batch: pa.RecordBatch) -> None:
        metadata = batch.column("metadata")
        frame = pl.DataFrame({
            "source": batch.column("source"),
            "kind": batch.column("kind"),
            "bin": length_bins(pc.utf8_length(batch.column("text")).to_numpy(zero_copy_only=False)),
            "language": pc.struct_field(metadata, "language"),
            "license": pc.struct_field(metadata, "license"),
        }).with_columns(pl.col("language", "license").fill_null(NOT_RECORDED))
        for counter, keys, rows in (
            (self.char_bins, ["source", "bin"], frame),
            (self.languages, ["source", "language"], frame),
            (self.kind_languages, ["kind", "language"], frame),
            (self.licences, ["source", "license"], frame.filter(pl.col("kind") == "code")),
        ):
            for *key, n in rows.group_by(keys).len().iter_rows():
                counter[tuple(key)] += n


def document_mix(directory: str) -> DocumentMix:
    """One streamed pass over the kept documents, reading only the source, kind, text and two metadata fields."""
    mix = DocumentMix()
    for path in output_paths(directory, "documents"):
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            parquet = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
            for batch in parquet.iter_batches(batch_size=DOCUMENT_BATCH, columns=DOCUMENT_COLUMNS, use_threads=False):
                mix.add(batch)
    return mix


def cluster_sizes(directory: str) -> Counter[tuple[str, int]]:
    """(dedup stage, members) -> clusters, from the clusters output's stage and cluster id columns only."""
    frames = []
    for path in output_paths(directory, "clusters"):
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            frames.append(pl.from_arrow(pq.read_table(f, columns=["stage", "cluster_id"])))
    if not frames:
        return Counter()
    sizes = pl.concat(frames).group_by("stage", "cluster_id").len().group_by("stage", "len").agg(pl.len().alias("n"))
    return Counter({(stage, size): n for stage, size, n in sizes.iter_rows()})


def token_lengths(shards_directory: str | Path) -> Counter[tuple[str, int]]:
    """(source, token-length bin) -> documents of a finished shard set; a document split over rows is summed.

    Reads only the `source` and `segments` columns of each shard's record batches.
    """
    directory = Path(shards_directory)
    manifest = read_manifest(directory)
    spans = []
    for entry in manifest.shards:
        with pa.memory_map(str(directory / entry.path)) as source:
            with ipc.open_file(source) as probe:
                wanted = [probe.schema.get_field_index("source"), probe.schema.get_field_index("segments")]
            reader = ipc.open_file(source, options=ipc.IpcReadOptions(included_fields=wanted))
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                segments = batch.column("segments")
                pieces = segments.flatten()
                spans.append(pl.DataFrame({
                    "source": pc.take(batch.column("source"), pc.list_parent_indices(segments)),
                    "document_id": pieces.field("document_id"),
                    "tokens": pc.subtract(pieces.field("doc_token_end"), pieces.field("doc_token_start")),
                }).group_by("source", "document_id").agg(pl.col("tokens").sum()))
    if not spans:
        return Counter()
    per_document = pl.concat(spans).group_by("source", "document_id").agg(pl.col("tokens").sum())
    per_document = per_document.with_columns(pl.Series("bin", length_bins(per_document["tokens"].to_numpy())))
    return Counter({(s, b): n for s, b, n in per_document.group_by("source", "bin").len().iter_rows()})


@dataclass
class ReportData:
    """Everything the page shows, aggregated; `tokens` is None where the build has no shard set."""

    directory: str
    stats: dict[str, Any]
    built_at: datetime | None
    mix: DocumentMix
    clusters: Counter[tuple[str, int]]
    tokens: Counter[tuple[str, int]] | None
    tokens_note: str
    mixture: list[list[Any]] = field(default_factory=list)  # [source, target, realised, realised / target] by budget


def mixture_rows(shards_directory: str) -> list[list[Any]]:
    """Target against realised tokens per source, when the shard set was built to token budgets."""
    sources = read_manifest(shards_directory).sources
    return [[name, s.target_tokens, s.tokens, f"{s.tokens / s.target_tokens:.1%}" if s.target_tokens else "-"]
            for name, s in sources.items() if s.target_tokens is not None]


def _modified(path: str) -> datetime | None:
    found = FileSystems.match([path])[0].metadata_list
    return datetime.fromtimestamp(found[0].last_updated_in_seconds, UTC) if found else None


def collect(directory: str, shards_directory: str | None = None, shown_as: tuple[str, str | None] | None = None) -> ReportData:
    """Read stats.json and aggregate the outputs (and the shard set, when the build made one); `shown_as` names
    the output and shard directories as the page should (a staged build is read before it takes its final name)."""
    directory = directory.rstrip("/")
    shown, shards_shown = shown_as or (directory, shards_directory)
    stats = read_stats(directory)
    tokens, note = None, "This build has no token counts: its config has no tokenize section, so no shard set was written."
    mixture: list[list[Any]] = []
    if shards_directory is not None:
        if (Path(shards_directory) / MANIFEST_FILENAME).exists():
            tokens = token_lengths(shards_directory)
            mixture = mixture_rows(shards_directory)
            note = f"Token lengths of the documents in the shard set {shards_shown}."
        else:
            note = f"No token counts: {shards_shown} holds no finished shard set (no {MANIFEST_FILENAME})."
    return ReportData(shown, stats, _modified(f"{directory}/{STATS_FILE}"), document_mix(directory),
                      cluster_sizes(directory), tokens, note, mixture)


def _layout(fig: go.Figure, title: str, x: str, y: str, **extra: Any) -> go.Figure:
    fig.update_layout(
        title=title, xaxis_title=x, yaxis_title=y, template="plotly_white", height=420,
        margin={"l": 10, "r": 10, "t": 60, "b": 10}, legend={"orientation": "h", "y": -0.2, "traceorder": "normal"}, **extra,
    )
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return fig


def _histogram(bins: Counter[tuple[str, int]], colors: dict[str, str], title: str, unit: str) -> go.Figure:
    """Grouped bars, one trace per source, over the log2 bins any source reached (empty bins between shown)."""
    reached = range(min(b for _, b in bins), max(b for _, b in bins) + 1)
    fig = go.Figure([
        go.Bar(name=source, x=[bin_label(b) for b in reached], y=[bins.get((source, b), 0) for b in reached],
               marker_color=color)
        for source, color in colors.items() if any(s == source for s, _ in bins)
    ])
    return _layout(fig, title, f"{unit} (log2 bins)", "documents", barmode="group")


def _stacked(by_category: dict[str, dict[str, int]], colors: dict[str, str], title: str, x: str, y: str,
             horizontal: bool = False) -> go.Figure:
    """One stacked bar per category, one trace per source (categories in the given order)."""
    categories = list(by_category)
    traces = []
    for source, color in colors.items():
        counts = [by_category[c].get(source, 0) for c in categories]
        if not any(counts):
            continue
        traces.append(go.Bar(name=source, y=categories, x=counts, orientation="h", marker_color=color) if horizontal
                      else go.Bar(name=source, x=categories, y=counts, marker_color=color))
    fig = _layout(go.Figure(traces), title, x, y, barmode="stack")
    if horizontal:
        fig.update_yaxes(autorange="reversed")
        fig.update_layout(height=max(320, 160 + 24 * len(categories)))
    return fig


def _funnel(steps: dict[str, list[tuple[str, int]]], colors: dict[str, str]) -> go.Figure:
    """Grouped horizontal bars: for each step, one bar per source, labelled with its share of that source's input."""
    traces = []
    for source, rows in steps.items():
        start = rows[0][1]
        traces.append(go.Bar(
            name=source, y=[s for s, _ in rows], x=[n for _, n in rows], orientation="h", marker_color=colors[source],
            text=[f"{n:,} ({n / start:.0%})" if start else f"{n:,}" for _, n in rows], textposition="outside",
            textfont={"size": 11}, constraintext="none", cliponaxis=False,
        ))
    fig = _layout(go.Figure(traces), "Documents left after each step, per source (share of the source's input)",
                  "documents", "", barmode="group")
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=max(420, 120 + 18 * len(steps) * len(FUNNEL_STEPS)))
    return fig


def source_colors(stats: dict[str, Any]) -> dict[str, str]:
    """One colour per source, in stats order, so a source looks the same in every chart."""
    palette = qualitative.Plotly
    return {name: palette[i % len(palette)] for i, name in enumerate(stats["sources"])}


def _pairs(counter: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """(source, value) counts -> value -> source -> n, values ordered by total, largest first."""
    totals: Counter[str] = Counter()
    out: dict[str, dict[str, int]] = {}
    for (source, value), n in counter.items():
        totals[value] += n
        out.setdefault(value, {})[source] = n
    return {v: out[v] for v, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))}


def figures(data: ReportData) -> dict[str, go.Figure]:
    """The page's charts by id, in page order; a chart with nothing to show is left out (the page says so)."""
    charts: dict[str, go.Figure] = {}
    colors = source_colors(data.stats)
    charts["funnel"] = _funnel(funnel(data.stats), colors)
    rejects = rejects_by_source(data.stats)
    if rejects:
        charts["rejects"] = _stacked(rejects, colors, "Rejects by stage:reason", "documents", "", horizontal=True)
    if data.mix.char_bins:
        charts["char_lengths"] = _histogram(data.mix.char_bins, colors, "Kept document length (characters)", "characters")
    if data.tokens:
        charts["token_lengths"] = _histogram(data.tokens, colors, "Document length in the shard set (tokens)", "tokens")
    if data.clusters:
        by_size = {str(size): {} for size in sorted({size for _, size in data.clusters})}
        for (stage, size), n in data.clusters.items():
            by_size[str(size)][stage] = n
        charts["clusters"] = _layout(
            go.Figure([go.Bar(name=stage, x=list(by_size), y=[by_size[s].get(stage, 0) for s in by_size])
                       for stage in sorted({stage for stage, _ in data.clusters})]),
            "Duplicate clusters by size", "members per cluster", "clusters", barmode="group", xaxis_type="category",
        )
    scores = quality_scores(data.stats)
    if scores:
        charts["quality_scores"] = _stacked(scores, colors, "Quality classifier score (every scored document, kept or "
                                            "rejected)", "probability of filters.classifier.label", "documents")
    redactions = redactions_by_source(data.stats)
    if redactions:
        charts["redactions"] = _stacked(redactions, colors, "Redactions by kind", "kind", "placeholders")
    if data.mix.languages:
        charts["languages"] = _stacked(_pairs(data.mix.languages), colors, "Kept documents by language (metadata.language)",
                                       "language", "documents")
    if data.mix.licences:
        charts["licences"] = _stacked(_pairs(data.mix.licences), colors, "Kept code documents by licence (metadata.license)",
                                      "licence", "documents")
    return charts


STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 0 1em 3em; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
.meta { color: #555; } .meta code { word-break: break-all; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.scroll { overflow-x: auto; }
.chart { margin: 1.5em 0; }
"""


def _html_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:,}" if isinstance(v, int) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _notes(data: ReportData, charts: dict[str, go.Figure]) -> list[str]:
    """Where the token counts come from, and what a left-out chart would have shown (an absent chart reads as
    "none", not as a bug)."""
    absent = {
        "rejects": "No document was rejected.",
        "char_lengths": "No document was kept, so there are no document lengths.",
        "clusters": "No duplicate cluster was found.",
        "redactions": "Nothing was redacted.",
    }
    return [data.tokens_note] + [text for chart, text in absent.items() if chart not in charts]


def render_html(data: ReportData, config: str | None = None) -> str:
    """The whole page: title and totals tables, then every chart, with plotly.js inlined once in the head."""
    stats = data.stats
    charts = figures(data)
    built = data.built_at.strftime("%Y-%m-%d %H:%M:%S UTC") if data.built_at else "unknown"
    steps = funnel(stats)
    step_names = [s for s, _ in next(iter(steps.values()))]
    sources = [[name, s["kind"], s["weight"], s["docs_in"], s["kept"], f"{s['kept'] / s['docs_in']:.1%}" if s["docs_in"] else "-",
                f"{s['bytes_kept'] / 1e6:,.3f}"] for name, s in stats["sources"].items()]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Corpus build report: {html.escape(config or data.directory)}</title>",
        f"<style>{STYLE}</style>", f'<script type="text/javascript">{get_plotlyjs()}</script>', "</head><body>",
        "<h1>Corpus build report</h1>",
        f'<p class="meta">config: <code>{html.escape(config or "not recorded")}</code><br>'
        f"output: <code>{html.escape(data.directory)}</code><br>built: {built} (when stats.json was written); "
        f"this page written {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}</p>",
        "<h2>Totals</h2>", _html_table(["totals", ""], [list(r) for r in summary_rows(stats)]),
        "<h2>Sources</h2>", _html_table(["source", "kind", "weight", "in", "kept", "kept %", "MB kept"], sources),
        "<h2>Documents left after each step</h2>",
        _html_table(["source", *step_names], [[name, *(n for _, n in rows)] for name, rows in steps.items()]),
        "<h2>Languages</h2>",
        "<p>Kept documents per language: the programming language of code documents, the language ID "
        "(ISO 639-1) of web documents.</p>",
        _html_table(["kind", "language", "documents"], [
            [kind, language, n] for (kind, language), n in sorted(data.mix.kind_languages.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))
        ]),
    ]
    if data.mixture:
        parts += ["<h2>Mixture</h2>", "<p>Tokens per source in the shard set against its budget (tokenize.mixture).</p>",
                  _html_table(["source", "target tokens", "realised tokens", "realised / target"], data.mixture)]
    parts += [
        "<h2>Charts</h2>",
    ]
    parts += [f"<p>{html.escape(note)}</p>" for note in _notes(data, charts)]
    for chart_id, fig in charts.items():
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{chart_id}", config=CHART_CONFIG,
                          default_width="100%")
        parts.append(f'<div class="chart">{div}</div>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html_report(directory: str, config: str | None = None, shards_directory: str | None = None,
                      shown_as: tuple[str, str | None] | None = None) -> str:
    """Write report.html beside report.md; `config` names the build's config file in the title."""
    path = f"{directory.rstrip('/')}/{REPORT_HTML_FILE}"
    page = render_html(collect(directory, shards_directory, shown_as), config)
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(page.encode("utf-8"))
    return path
