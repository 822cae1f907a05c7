"""The human report of a corpus build: Markdown tables (with text bar charts) computed by polars over
the build's own outputs, plus the short summary rows the CLI and the demo print.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import polars as pl
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from ember.pipelines.corpus.decontaminate import REASON_PREFIX as DECONTAMINATION_REASON, STAGE as DECONTAMINATION_STAGE
from ember.pipelines.quality.decontamination import item_of
from ember.schemas.documents import CORPUS_TABLES, REPORT_FILE, STATS_FILE

BAR_WIDTH = 30


def read_stats(directory: str) -> dict[str, Any]:
    with FileSystems.open(f"{directory.rstrip('/')}/{STATS_FILE}", compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return json.loads(f.read())


def output_paths(directory: str, name: str) -> list[str]:
    """The Parquet parts of one output (documents, rejects, clusters), sorted."""
    pattern = f"{directory.rstrip('/')}/{name}/**.parquet"
    return sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)


def read_output(directory: str, name: str) -> pl.DataFrame:
    """All shards of one output (documents, rejects, clusters) as one frame; empty with the schema when none."""
    schema = CORPUS_TABLES[name]
    tables = []
    for path in output_paths(directory, name):
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            tables.append(pq.read_table(io.BytesIO(f.read())))
    if not tables:
        return pl.from_arrow(schema.empty_table())
    return pl.concat([pl.from_arrow(t) for t in tables])


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _bar(value: int, largest: int) -> str:
    return "█" * max(1, round(BAR_WIDTH * value / largest)) if largest and value else ""


def file_counts(stats: dict[str, Any]) -> tuple[int, int]:
    """Input files read, and those that broke part way (the read stage's `files` / `files_unreadable`)."""
    read = [s["stages"].get("read", {}) for s in stats["sources"].values()]
    return sum(r.get("files", 0) for r in read), sum(r.get("files_unreadable", 0) for r in read)


BREAK_RULE = "rows before a break are kept; the unknown rest of each such file counts as one unreadable_file reject"


def summary_rows(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs: documents in/kept/rejected by reason, duplicates removed, redactions."""
    totals = stats["totals"]
    rows = [
        ("documents in", f"{totals['docs_in']:,}"),
        ("documents kept", f"{totals['kept']:,}"),
        ("documents rejected", f"{totals['rejected']:,}"),
    ]
    rows += [(f"  rejected {reason}", f"{n:,}") for reason, n in totals["rejected_by_reason"].items()]
    for stage in ("exact_dedup", "near_dedup"):
        d = stats["dedup"][stage]
        rows.append((f"{stage} removed", f"{d['removed']:,} in {d['clusters']:,} clusters"))
    earlier = stats["dedup"]["near_dedup"].get("earlier_release_removed")
    if earlier is not None:
        rows.append(("near_dedup duplicates of an earlier release", f"{earlier:,}"))
    redactions = sorted(totals["redactions"].items())
    rows.append(("redactions", f"{sum(n for _, n in redactions):,}"))
    rows += [(f"  redacted {kind}", f"{n:,}") for kind, n in redactions]
    rows.append(("balanced (in = kept + rejected)", "yes" if totals["balanced"] else "NO"))
    files, unreadable = file_counts(stats)
    rows.append(("input files unreadable past a point", f"{unreadable:,} of {files:,}" + (f" ({BREAK_RULE})" if unreadable else "")))
    return rows


@dataclass(frozen=True)
class SourceWarning:
    """One reason that rejected more than the warn share of a source's documents, and what to change."""

    source: str
    reason: str  # "stage:reason" as in stats.json
    rejected: int
    docs_in: int
    fix: str

    @property
    def share(self) -> float:
        return self.rejected / self.docs_in

    def message(self) -> str:
        return (f"source {self.source!r}: {self.reason} rejected {self.rejected:,} of {self.docs_in:,} "
                f"documents ({self.share:.0%}). Fix: {self.fix}")


_LICENSE_DETAIL = re.compile(r"^license (['\"])(.*)\1$")

FIXES = {
    "filter:license_not_allowed": "add the licences to filters.code.licenses (or set it to null: no licence filter)",
    "filter:language_not_allowed": "add the languages to filters.code.languages (null keeps every language)",
    "filter:too_short": "lower filters.code.min_chars (null: off)",
    "filter:too_long": "raise filters.code.max_chars (null: off)",
    "filter:max_line_length": "raise filters.code.max_line_length (null: off)",
    "filter:mean_line_length": "raise filters.code.max_mean_line_length (null: off)",
    "filter:alphanum_fraction": "lower filters.code.min_alphanum_fraction (null: off)",
    "filter:data_file": "raise filters.code.data_max_chars or shorten filters.code.data_extensions",
    "filter:encoded_data": "raise filters.code.max_encoded_fraction (null: off)",
    "read:unreadable_file": "the input files break part way; the rejects' locations say where",
    "read:missing_text_field": "fields.text names no field of these records; point it at the text field",
    "read:missing_id_field": "fields.id names no field of these records; fix it or set it to null",
    "read:control_characters": "set the source's control_characters: strip",
    "read:line_too_long": "raise the source's max_line_bytes (each worker thread holds a few times it per line)",
    "read:html_timeout": "raise the source's html.time_limit_s",
    "read:html_too_large": "raise the source's html.max_bytes",
    "read:html_empty": "set the source's html.main_content: false (keeps all visible text)",
    "redact:redaction_timeout": "raise redaction.time_limit_s (null: no limit)",
    "unique_ids:duplicate_id": "fields.id is not unique in this source; set it to null for content-addressed ids",
    "exact_dedup:exact_duplicate": "the inputs repeat themselves; check the source's globs for overlaps",
    "near_dedup:near_duplicate": "more dedup.bands x rows_per_band raise the threshold; dedup.near: false turns it off",
}


def _seen_licenses(rejects: pl.LazyFrame, source: str, top: int = 5) -> list[tuple[str, int]]:
    """The licences of a source's license_not_allowed rejects, most frequent first (from each reject's detail)."""
    details = rejects.filter((pl.col("source") == source) & (pl.col("reason") == "license_not_allowed")).collect()["detail"]
    counts: dict[str, int] = {}
    for detail in details:
        match = _LICENSE_DETAIL.match(detail or "")
        if match:
            counts[match.group(2)] = counts.get(match.group(2), 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]


def source_warnings(stats: dict[str, Any], rejects: Callable[[], pl.LazyFrame], warn_share: float) -> list[SourceWarning]:
    """Every (source, reason) that rejected more than `warn_share` of the source's documents; `rejects`
    is read only for a licence warning, whose fix names the licences seen."""
    found = []
    for name, source in stats["sources"].items():
        docs_in = source["docs_in"]
        for reason, n in sorted(source["rejected"].items(), key=lambda kv: (-kv[1], kv[0])):
            if not docs_in or n / docs_in <= warn_share:
                continue
            fix = FIXES.get(reason, f"see the {reason} rejects in rejects/ and the filters' settings")
            if reason == "filter:license_not_allowed":
                seen = _seen_licenses(rejects(), name)
                if seen:
                    listed = ", ".join(f"{lic} ({k:,})" for lic, k in seen)
                    fix = (f"licences seen most: {listed}; if they are acceptable, add "
                           f"[{', '.join(lic.lower() for lic, _ in seen)}] to filters.code.licenses")
            found.append(SourceWarning(name, reason, n, docs_in, fix))
    return found


@dataclass(frozen=True)
class VanishedSource:
    """A source that kept no document, or fewer than the config's floor: the output lacks what it was meant to add."""

    source: str
    kept: int
    docs_in: int
    rejected: tuple[tuple[str, int], ...]  # ("stage:reason", n), most first

    def message(self) -> str:
        if not self.docs_in:
            return f"source {self.source!r} read no documents: its inputs hold none"
        reasons = ", ".join(f"{reason} {n:,} ({n / self.docs_in:.0%})" for reason, n in self.rejected)
        return f"source {self.source!r} kept {self.kept:,} of {self.docs_in:,} documents; rejected by {reasons}"


def vanished_sources(stats: dict[str, Any], min_kept_share: float) -> list[VanishedSource]:
    """Every source that kept nothing, or less than `min_kept_share` of what it read, with each reason's count."""
    found = []
    for name, source in stats["sources"].items():
        docs_in, kept = source["docs_in"], source["kept"]
        if kept and kept >= min_kept_share * docs_in:
            continue
        rejected = tuple(sorted(source["rejected"].items(), key=lambda kv: (-kv[1], kv[0])))
        found.append(VanishedSource(name, kept, docs_in, rejected))
    return found


def build_warnings(directory: str, warn_share: float) -> list[SourceWarning]:
    """`source_warnings` of the finished build in `directory`."""
    return source_warnings(read_stats(directory), lambda: read_output(directory, "rejects").lazy(), warn_share)


def _duplicates(stats: dict[str, Any], clusters: pl.DataFrame) -> list[str]:
    out = ["\n\n## Duplicates\n"]
    near = stats["dedup"]["near_dedup"]
    out.append(
        f"Near-duplicate threshold (LSH): Jaccard ≈ {near['jaccard_threshold']}; connected components "
        f"ran {near['cc_max_rounds']} large/small-star rounds, unconverged edges: {near['cc_unconverged_edges']}.\n"
    )
    rows = []
    for stage in ("exact_dedup", "near_dedup"):
        d = stats["dedup"][stage]
        rows.append([stage, d["clusters"], d["removed"], ", ".join(f"{k}: {v}" for k, v in d["cluster_sizes"].items())])
    out.append(_table(["stage", "clusters", "removed", "cluster sizes"], rows))
    if "earlier_release_removed" in near:
        out.append(f"\nDuplicates of an earlier release (`dedup.against`), not in the table: {near['earlier_release_removed']:,}.\n")
    if clusters.height:
        largest_clusters = (
            clusters.group_by("stage", "cluster_id").agg(pl.len().alias("members"))
            .sort(["members", "cluster_id"], descending=[True, False]).head(10)
        )
        out.append("\n\nLargest clusters (the cluster id is the kept representative's document id):\n")
        out.append(_table(["stage", "cluster id", "members"], [list(r) for r in largest_clusters.iter_rows()]))
    return out


def _decontamination(stats: dict[str, Any], rejects: pl.DataFrame, top: int = 10) -> list[str]:
    """Per benchmark: documents removed per source, and the items matched most (from the rejects' details)."""
    if not any(DECONTAMINATION_STAGE in s["stages"] for s in stats["sources"].values()):
        return []
    out = ["\n\n## Decontamination\n"]
    removed = rejects.filter(pl.col("stage") == DECONTAMINATION_STAGE)
    if not removed.height:
        return out + ["No document held a benchmark item."]
    removed = removed.with_columns(
        pl.col("reason").str.strip_prefix(DECONTAMINATION_REASON).alias("benchmark"),
        pl.col("detail").map_elements(item_of, return_dtype=pl.String).alias("item"),
    )
    for (benchmark,), rows in sorted(removed.group_by("benchmark"), key=lambda kv: kv[0]):
        out.append(f"\n### {benchmark}: {rows.height:,} documents removed\n")
        by_source = rows.group_by("source").agg(pl.len().alias("n")).sort(["n", "source"], descending=[True, False])
        out.append(_table(["source", "documents removed"], [list(r) for r in by_source.iter_rows()]))
        items = (
            rows.group_by("item").agg(pl.len().alias("n"), pl.col("detail").sort().first().alias("example"))
            .sort(["n", "item"], descending=[True, False]).head(top)
        )
        largest = int(items["n"].max())
        out.append(f"\n\nItems matched most (top {top}):\n")
        out.append(_table(["item", "documents", "", "first match"],
                          [[item, n, _bar(n, largest), example] for item, n, example in items.iter_rows()]))
    return out


def _kept_documents(documents: pl.DataFrame) -> list[str]:
    out = ["\n\n## Kept documents\n"]
    if not documents.height:
        return out + ["No document was kept."]
    lengths = (
        documents.with_columns(pl.col("text").str.len_chars().alias("chars"))
        .group_by("source", "kind")
        .agg(pl.len().alias("docs"), pl.col("chars").median().alias("median chars"),
             pl.col("chars").quantile(0.9).alias("p90 chars"))
        .sort("source")
    )
    out.append(_table(["source", "kind", "docs", "median chars", "p90 chars"], [list(r) for r in lengths.iter_rows()]))
    code = documents.filter(pl.col("kind") == "code")
    if code.height:
        languages = (
            code.select(pl.col("metadata").struct.field("language").fill_null("unknown").alias("language"))
            .group_by("language").agg(pl.len().alias("n")).sort(["n", "language"], descending=[True, False])
        )
        largest = int(languages["n"].max())
        out.append("\n\nCode languages (programming language per document):\n")
        out.append(_table(["language", "n", ""], [[lang, n, _bar(n, largest)] for lang, n in languages.iter_rows()]))
    web = documents.filter(pl.col("kind") == "web")
    if web.height:
        metadata = pl.col("metadata")
        languages = (
            web.select(metadata.struct.field("language").fill_null("not identified").alias("language"),
                       metadata.struct.field("language_score").alias("score"))
            .group_by("language").agg(pl.len().alias("n"), pl.col("score").mean().alias("mean confidence"))
            .sort(["n", "language"], descending=[True, False])
        )
        largest = int(languages["n"].max())
        out.append("\n\nWeb languages (language ID, ISO 639-1):\n")
        out.append(_table(["language", "n", "mean confidence", ""], [
            [lang, n, "" if score is None else float(score), _bar(n, largest)] for lang, n, score in languages.iter_rows()
        ]))
    return out


def render_report(directory: str, shown_as: str | None = None, min_kept_share: float = 0.0) -> str:
    """The report of the build in `directory`; `shown_as` names it where it will live (it may be staged elsewhere).
    Sources that vanished (`vanished_sources`) come first, before anything a reader could stop at."""
    stats = read_stats(directory)
    documents = read_output(directory, "documents")
    rejects = read_output(directory, "rejects")
    clusters = read_output(directory, "clusters")
    totals = stats["totals"]
    vanished = vanished_sources(stats, min_kept_share)
    out = ["".join(f"**Vanished: {v.message()}.**\n\n" for v in vanished) + "# Corpus build report\n",
           f"Output: `{shown_as or directory}`\n"]

    out.append("## Totals\n")
    out.append(_table(["", "documents", "MB"], [
        ["in", totals["docs_in"], totals["bytes_in"] / 1e6],
        ["kept", totals["kept"], totals["bytes_kept"] / 1e6],
        ["rejected", totals["rejected"], ""],
    ]))
    out.append(f"\nEvery input unit accounted for (in = kept + rejected): **{'yes' if totals['balanced'] else 'NO'}**\n")
    files, unreadable = file_counts(stats)
    out.append(f"Input files unreadable past a point: **{unreadable:,} of {files:,}** ({BREAK_RULE}, so `in` is a lower bound for them).\n")

    out.append("## Sources\n")
    rows = []
    for name, s in stats["sources"].items():
        kept_share = s["kept"] / s["docs_in"] if s["docs_in"] else 0.0
        rows.append([name, s["kind"], s["weight"], s["docs_in"], s["kept"], f"{kept_share:.1%}", s["bytes_kept"] / 1e6])
    out.append(_table(["source", "kind", "weight", "in", "kept", "kept %", "MB kept"], rows))

    out.append("\n## Documents after each stage\n")
    stages = ["read", "filter", "exact_dedup", "output"]
    rows = [[name] + [s["stages"].get(st, {}).get("docs_out", "") for st in stages] for name, s in stats["sources"].items()]
    out.append(_table(["source", *stages], rows))

    out.append("\n## Rejects by stage and reason\n")
    if rejects.height:
        by_reason = (
            rejects.group_by("stage", "reason")
            .agg(pl.len().alias("n"), pl.col("location").sort().first().alias("example"))
            .sort(["n", "stage", "reason"], descending=[True, False, False])
        )
        largest = int(by_reason["n"].max())
        out.append(_table(["stage", "reason", "n", "", "first location"], [
            [r["stage"], r["reason"], r["n"], _bar(r["n"], largest), f"`{r['example']}`"] for r in by_reason.iter_rows(named=True)
        ]))
    else:
        out.append("No rejects.")

    out.append("\n\n## Redactions\n")
    redactions = sorted(totals["redactions"].items())
    if redactions:
        largest = max(n for _, n in redactions)
        out.append(_table(["type", "n", ""], [[k, n, _bar(n, largest)] for k, n in redactions]))
    else:
        out.append("None.")

    out += _decontamination(stats, rejects)
    out += _duplicates(stats, clusters)
    out += _kept_documents(documents)
    return "\n".join(out) + "\n"


def write_report(directory: str, shown_as: str | None = None, min_kept_share: float = 0.0) -> str:
    path = f"{directory.rstrip('/')}/{REPORT_FILE}"
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(render_report(directory, shown_as, min_kept_share).encode("utf-8"))
    return path
