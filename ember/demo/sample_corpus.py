"""Small real mixed code + web inputs with known contents: clean documents, exact and near duplicates,
secrets, malformed lines, an empty file, in every supported format. Seeded, so the demo, the tests and
the benchmarks see the same bytes on every run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
import zstandard

_NOUNS = (
    "river garden village market teacher doctor engine window harbor forest mountain library kitchen bridge "
    "island museum station orchard festival journey painter farmer council letter morning evening winter summer "
    "student neighbor canal valley tower bakery lantern meadow castle ferry quarry workshop theater chapel "
    "harvest cottage factory railway lighthouse vineyard monastery glacier desert compass manuscript"
).split()
_VERBS = (
    "visited described repaired painted followed opened carried discovered measured collected welcomed "
    "explored crossed studied improved restored recorded protected delivered gathered admired completed"
).split()
_ADJECTIVES = (
    "quiet ancient narrow busy golden distant famous gentle modern wooden crowded peaceful northern sunny "
    "hidden sturdy colorful humble elegant rustic patient curious generous careful"
).split()
_ADVERBS = "slowly carefully quickly proudly gladly quietly often rarely eagerly patiently".split()
_PLACES = "Lisbon Porto Bergen Kyoto Quebec Dublin Krakow Verona Tallinn Ghent Split Lucerne Bruges Galway".split()


_TEMPLATES = (
    "The {adj} {noun} near {place} was {verb} {adv} by the {noun2} of the {adj2} {noun3}.",
    "In {place}, a {adj} {noun} {verb} the {noun2} and {adv} {verb2} every {adj2} {noun3}.",
    "Many {noun}s have {verb} a {adj} {noun2} with {adj2} {noun3}s from {place}.",
    "That {noun} {adv} {verb} its {adj} {noun2}, so the {noun3} of {place} {verb2} it too.",
    "Before {adj} {noun}s {verb} the {noun2}, {place} {verb2} the {adj2} {noun3} {adv}.",
)


def prose(rng: random.Random, sentences: int) -> str:
    """English-like paragraphs that datatrove's Gopher, C4 and FineWeb filters accept."""
    lines = []
    for _ in range(sentences):
        noun, noun2, noun3 = rng.sample(_NOUNS, 3)
        adj, adj2 = rng.sample(_ADJECTIVES, 2)
        verb, verb2 = rng.sample(_VERBS, 2)
        lines.append(
            rng.choice(_TEMPLATES).format(
                adj=adj, adj2=adj2, noun=noun, noun2=noun2, noun3=noun3, verb=verb, verb2=verb2,
                adv=rng.choice(_ADVERBS), place=rng.choice(_PLACES),
            )
        )
    return "\n".join(lines)


def code_file(rng: random.Random, functions: int) -> str:
    """A Python module of small distinct functions."""
    parts = ['"""Utilities for the {0} service."""\n\nimport math\n'.format(rng.choice(_NOUNS))]
    for i in range(functions):
        name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{i}"
        a, b = rng.sample("abcdefghxyz", 2)
        k = rng.randint(2, 97)
        parts.append(
            f"\ndef {name}({a}, {b}):\n"
            f'    """Return the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} of {a} and {b}."""\n'
            f"    total = {a} * {k} + {b}\n"
            f"    if total > {rng.randint(10, 999)}:\n"
            f"        return math.sqrt(total)\n"
            f"    return total - {rng.randint(1, 50)}\n"
        )
    return "".join(parts)


def near_duplicate(rng: random.Random, text: str, edits: int) -> str:
    """`text` with a few words replaced: the planted near-duplicate."""
    words = text.split(" ")
    for _ in range(edits):
        words[rng.randrange(len(words))] = rng.choice(_NOUNS)
    return " ".join(words)


@dataclass
class SampleCorpus:
    """What was written, so callers can check outcomes against it."""

    web_glob: str
    code_glob: str
    expected_reasons: dict[str, int] = field(default_factory=dict)
    near_duplicate_pairs: int = 0
    secrets_planted: int = 0

    def config(self, output_dir: str) -> dict:
        return {
            "sources": [
                {"name": "web", "kind": "web", "inputs": [self.web_glob], "format": "jsonl",
                 "fields": {"text": "text", "metadata": {"url": "url"}}, "weight": 0.3},
                {"name": "web_zst", "kind": "web", "inputs": [self.web_glob.replace("*.jsonl", "*.jsonl.zst")],
                 "format": "jsonl.zst", "fields": {"text": "content", "metadata": {"url": "meta.url"}}, "weight": 0.2},
                {"name": "code", "kind": "code", "inputs": [self.code_glob], "format": "parquet",
                 "fields": {"text": "content", "metadata": {"repo": "repo", "path": "path", "license": "license",
                                                            "stars": "stars"}}, "weight": 0.5},
                {"name": "code_gz", "kind": "code", "inputs": [self.code_glob.replace("*.parquet", "*.jsonl.gz")],
                 "format": "jsonl.gz", "fields": {"text": "text", "id": "id",
                                                  "metadata": {"path": "path", "license": "license"}}, "weight": 0.1},
            ],
            "output": {"directory": output_dir, "rows_per_shard": 16},
        }


def write_sample_corpus(directory: Path, web_docs: int = 24, code_docs: int = 16, seed: int = 7) -> SampleCorpus:
    """Write the mixed sample under `directory` (web/ and code/) and say what it contains."""
    rng = random.Random(seed)
    web_dir, code_dir = directory / "web", directory / "code"
    web_dir.mkdir(parents=True, exist_ok=True)
    code_dir.mkdir(parents=True, exist_ok=True)
    reasons: dict[str, int] = {}

    def expect(reason: str, n: int = 1) -> None:
        reasons[reason] = reasons.get(reason, 0) + n

    # web/part-0.jsonl: clean pages, one exact and one near duplicate, secrets, and malformed lines.
    pages = [prose(rng, rng.randint(8, 12)) for _ in range(web_docs)]
    pages[1] = pages[1] + "\nWrite to jane.doe@example.org or call the office at 93.184.216.34 before noon."
    lines = [json.dumps({"text": t, "url": f"https://example.org/{i}"}) for i, t in enumerate(pages)]
    lines.append(json.dumps({"text": pages[2], "url": "https://mirror.example.org/2"}))  # exact duplicate
    expect("exact_dedup:exact_duplicate")
    lines.append(json.dumps({"text": near_duplicate(rng, pages[3], 2), "url": "https://example.org/3b"}))
    expect("near_dedup:near_duplicate")
    lines.append('{"text": "unterminated')
    expect("read:invalid_json")
    lines.append(json.dumps({"url": "https://example.org/no-text"}))
    expect("read:missing_text_field")
    lines.append(json.dumps({"text": "Buy our product today, it is the best.\n" * 40}))
    expect("filter:gopher_repetition:dup_line_frac")
    lines.append("   ")
    expect("read:blank_line")
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    raw += b'{"text": "bad byte \xff here"}\n'
    expect("read:invalid_utf8")
    (web_dir / "part-0.jsonl").write_bytes(raw)
    (web_dir / "empty.jsonl").write_bytes(b"")
    expect("read:empty_file")

    # web/part-1.jsonl.zst: a second web source with nested fields, one cross-source exact duplicate.
    zst_pages = [prose(rng, rng.randint(8, 12)) for _ in range(6)] + [pages[4]]
    expect("exact_dedup:exact_duplicate")
    zst = "\n".join(json.dumps({"content": t, "meta": {"url": f"https://news.example.com/{i}"}}) for i, t in enumerate(zst_pages))
    (web_dir / "part-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(zst.encode("utf-8")))

    # code/part-0.parquet: modules with repo metadata, secrets, a near duplicate with fewer stars, rejects.
    modules = [code_file(rng, rng.randint(4, 7)) for _ in range(code_docs)]
    modules[0] = modules[0] + '\nAWS_ACCESS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"\npassword = "hunter2hunter2"\n'
    secrets = 2 + 2  # the email and IP above, the two here
    rows = [
        {"content": m, "repo": f"org/repo{i}", "path": f"src/mod{i}.py", "license": "MIT", "stars": 10 + i}
        for i, m in enumerate(modules)
    ]
    rows.append({"content": near_duplicate(rng, modules[5], 2), "repo": "fork/repo5", "path": "src/mod5.py",
                 "license": "MIT", "stars": 1})
    expect("near_dedup:near_duplicate")
    rows.append({"content": "x = 1\n" + "y" * 1500 + "\n", "repo": "org/minified", "path": "min.js",
                 "license": "MIT", "stars": 3})
    expect("filter:max_line_length")
    rows.append({"content": "# Code generated by protoc. DO NOT EDIT.\n" + modules[6], "repo": "org/gen",
                 "path": "gen_pb2.py", "license": "MIT", "stars": 3})
    expect("filter:autogenerated")
    rows.append({"content": modules[7] + "\n# v2\n", "repo": "org/gpl", "path": "gpl.py", "license": "GPL-3.0",
                 "stars": 3})
    expect("filter:license_not_allowed")
    rows.append({"content": None, "repo": "org/none", "path": "none.py", "license": "MIT", "stars": 1})
    expect("read:missing_text_field")
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, code_dir / "part-0.parquet")

    # code/part-1.jsonl.gz: ids from a field, one repeated with other content, one stars-typed wrongly.
    gz_modules = [code_file(rng, rng.randint(4, 7)) for _ in range(4)]
    gz_lines = [json.dumps({"id": f"f{i}", "text": m, "path": f"lib/f{i}.go", "license": "apache-2.0"}) for i, m in enumerate(gz_modules)]
    gz_lines.append(json.dumps({"id": "f0", "text": code_file(rng, 3), "path": "lib/dup.go", "license": "apache-2.0"}))
    expect("unique_ids:duplicate_id")
    gz_lines.append(json.dumps({"text": gz_modules[0] + "\n", "path": "lib/noid.go"}))
    expect("read:missing_id_field")
    (code_dir / "part-1.jsonl.gz").write_bytes(gzip.compress(("\n".join(gz_lines) + "\n").encode("utf-8"), mtime=0))

    return SampleCorpus(
        web_glob=str(web_dir / "*.jsonl"),
        code_glob=str(code_dir / "*.parquet"),
        expected_reasons=reasons,
        near_duplicate_pairs=2,
        secrets_planted=secrets,
    )


QUICKSTART_TOKENIZE = {"tokenizer": {"name": "cl100k_base"}, "seq_len": 512, "sequences_per_shard": 16}
"""Small enough that the docs' corpus quickstart (and its test) packs the sample in seconds."""


def write_quickstart(directory: Path) -> Path:
    """The sample under DIR/input and DIR/corpus.yaml, a build config for it whose paths are relative to DIR
    (output DIR/corpus, shards DIR/corpus/shards), so the directory can be moved or copied as a whole."""
    sample = write_sample_corpus(directory / "input")
    config = sample.config("corpus")
    for source in config["sources"]:
        source["inputs"] = [os.path.relpath(path, directory) for path in source["inputs"]]
    config["tokenize"] = QUICKSTART_TOKENIZE
    path = directory / "corpus.yaml"
    path.write_text(f"# Written by `python -m ember.demo.sample_corpus {directory}`: the sample under input/.\n"
                    + yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m ember.demo.sample_corpus DIR`: the inputs of the docs' quickstarts, without `ember demo`."""
    parser = argparse.ArgumentParser(prog="python -m ember.demo.sample_corpus", description=main.__doc__)
    parser.add_argument("directory", type=Path, help="where to write input/ and corpus.yaml (created)")
    config = write_quickstart(parser.parse_args(argv).directory)
    print(f"wrote the sample corpus under {config.parent / 'input'} and its build config {config}")


if __name__ == "__main__":
    main()
