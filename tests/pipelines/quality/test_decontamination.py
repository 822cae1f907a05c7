"""Benchmark matching (ember/pipelines/quality/decontamination.py): planted HumanEval contamination is found with the
right item, clean standard-library code is not, and benchmark files fail with the file and record named."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.pipelines.quality.decontamination import (
    BenchmarkIndex, BenchmarkItem, DecontaminationError, Match, Settings, Tokens, item_of, read_items,
    renamed_windows, windows,
)

from tests.pipelines.decontamination_cases import (
    COMMENT_STYLES, KINDS, comment_block, commented_docstring, docstring, function, humaneval_items, planted, read,
    stdlib_files,
)

FIELDS = {"id": "id", "prompt": "prompt", "solution": "solution", "tests": "tests"}
MAX_FALSE_POSITIVE_RATE = 0.005
MIN_RENAMED_RECALL = 0.95
# Prompts whose docstring is one 13-token sentence under a whole helper function: too small a part of the prompt.
DOCSTRING_TOO_SHORT = {"HumanEval/38", "HumanEval/50"}


@pytest.fixture(scope="module")
def items() -> list[BenchmarkItem]:
    return humaneval_items()


@pytest.fixture(scope="module")
def index(items: list[BenchmarkItem]) -> BenchmarkIndex:
    return BenchmarkIndex(items)


@pytest.mark.parametrize("kind", KINDS)
def test_planted_humaneval_items_are_found_with_their_id(kind: str, items: list[BenchmarkItem], index: BenchmarkIndex,
                                                         record_property) -> None:
    hosts = [read(p) for p in stdlib_files(20, seed=1)]
    found = [index.match(planted(item, kind, hosts[k % len(hosts)], seed=k)) for k, item in enumerate(items)]
    right = sum(m is not None and m.item_id == item.id and m.benchmark == "humaneval" for m, item in zip(found, items))
    recall = right / len(items)
    record_property(f"recall_{kind}", recall)
    print(f"{kind}: {right}/{len(items)} planted items found")
    if kind == "renamed":  # a few items are a one-line solution under a short docstring: too little left to match
        assert recall >= MIN_RENAMED_RECALL
        assert any(m is not None and m.kind == "renamed_ngram" for m in found)
    elif kind == "commented_docstring":  # a docstring alone is part of a prompt: shared n-grams, not the whole
        missed = {item.id for m, item in zip(found, items) if m is None or m.item_id != item.id}
        assert missed <= DOCSTRING_TOO_SHORT
        assert {m.kind for m in found if m is not None} == {"ngram"}
    else:
        assert right == len(items)
        assert {m.kind for m in found} == {"substring"}


@pytest.mark.parametrize("style", COMMENT_STYLES)
def test_a_docstring_copied_as_a_comment_block_is_found_however_indented(
    style: str, items: list[BenchmarkItem], index: BenchmarkIndex
) -> None:
    for indent in ("", "      ", "\t\t"):
        missed = set()
        for item in items:
            found = index.match(comment_block(docstring(item), style, indent) + "int port(void);\n")
            if found is None or found.item_id != item.id:
                missed.add(item.id)
        assert missed <= DOCSTRING_TOO_SHORT, (style, repr(indent))


def test_a_comment_block_tokenises_as_its_text() -> None:
    item = humaneval_items()[0]
    text = docstring(item)
    assert Tokens.of(commented_docstring(item, "block")).units[: len(Tokens.of(text))].tolist() == Tokens.of(text).units.tolist()
    assert Tokens.of(item.prompt).units.tolist() == Tokens.of(comment_block(item.prompt, "slash", "  ")).units.tolist()


LINE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"), max_size=40)


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(LINE, max_size=8), style=st.sampled_from(COMMENT_STYLES), indent=st.sampled_from(["", "  ", "\t", "        "]))
def test_any_text_commented_in_any_style_tokenises_as_the_text(lines: list[str], style: str, indent: str) -> None:
    text = "\n".join(lines)
    assert Tokens.of(comment_block(text, style, indent)).units.tolist() == Tokens.of(text).units.tolist()


def test_clean_code_commented_out_is_not_flagged(index: BenchmarkIndex) -> None:
    """Markers dropped on both sides add no false positive: standard-library files turned into comment blocks."""
    files = stdlib_files(100, seed=7)
    flagged = [(p.name, style, m) for k, p in enumerate(files)
               if (m := index.match(comment_block(read(p), style := COMMENT_STYLES[k % len(COMMENT_STYLES)], "  "))) is not None]
    assert flagged == []


def test_clean_standard_library_code_is_not_flagged(index: BenchmarkIndex, record_property) -> None:
    files = stdlib_files(400, seed=7)
    flagged = [(p.name, m) for p in files if (m := index.match(read(p))) is not None]
    rate = len(flagged) / len(files)
    record_property("false_positive_rate", rate)
    print(f"false positives: {len(flagged)} of {len(files)} stdlib files ({rate:.2%}): {flagged}")
    assert rate <= MAX_FALSE_POSITIVE_RATE


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(), at=st.integers(min_value=0), k=st.integers(min_value=0))
def test_a_benchmark_function_inserted_anywhere_in_any_text_is_found(
    items: list[BenchmarkItem], index: BenchmarkIndex, text: str, at: int, k: int
) -> None:
    item = items[k % len(items)]
    at %= len(text) + 1
    found = index.match(text[:at] + "\n" + function(item) + "\n" + text[at:])
    assert found is not None and found.item_id == item.id


def test_whitespace_and_case_never_matter(index: BenchmarkIndex, items: list[BenchmarkItem]) -> None:
    item = items[0]
    squashed = " ".join(function(item).upper().split())
    found = index.match(squashed)
    assert found == Match("humaneval", item.id, "prompt", "substring", len(Tokens.of(item.prompt)), len(Tokens.of(item.prompt)))


def test_ngrams_shared_across_the_benchmark_are_ignored() -> None:
    header = ("import sys\nimport math\nfrom collections import defaultdict, Counter, deque\n"
              "from itertools import accumulate, permutations\ninput = sys.stdin.readline\n"
              "sys.setrecursionlimit(10 ** 6)\nMOD = 10 ** 9 + 7\n")
    bodies = [f"def solve_{k}(values):\n    return sum(v * {k} for v in values if v % {k + 2})\n" for k in range(20)]
    apps = [BenchmarkItem("apps", str(k), "", header + b) for k, b in enumerate(bodies)]
    boilerplate_only = "# my script\n" + header + "print('hello')\n"
    no_common = Settings(min_substring_tokens=1000)
    alone = BenchmarkIndex(apps[3:4], no_common).match(boilerplate_only)
    assert alone is not None and alone.item_id == "3"  # the header is most of an item's n-grams
    index = BenchmarkIndex(apps, no_common)
    assert index.ignored["apps"] > 0 and index.match(boilerplate_only) is None
    found = index.match("# my script\n" + header + bodies[3])
    assert found is not None and (found.item_id, found.kind) == ("3", "ngram")


def test_short_fields_never_match_whole(index: BenchmarkIndex) -> None:
    assert index.match("def length(s):\n    return len(string)\n") is None  # HumanEval/23's whole solution, 5 tokens


def test_renamed_windows_see_through_consistent_renaming() -> None:
    a = Tokens.of("for idx, elem in enumerate(numbers):\n    if elem > idx:\n        total += elem * idx\n")
    b = Tokens.of("for i, x in enumerate(values):\n    if x > i:\n        total += x * i\n")
    assert len(windows(a.units, 8)) and set(windows(a.units, 8).tolist()).isdisjoint(windows(b.units, 8).tolist())
    assert renamed_windows(a, 8, 4).tolist() == renamed_windows(b, 8, 4).tolist() != []
    swapped = Tokens.of("for i, x in enumerate(values):\n    if i > x:\n        total += x * i\n")
    assert renamed_windows(a, 8, 4).tolist() != renamed_windows(swapped, 8, 4).tolist()


def test_the_reject_detail_names_the_item_and_parses_back() -> None:
    match = Match("mbpp", 'task "7" / a', "solution", "ngram", 12, 20)
    assert match.detail() == 'item "task \\"7\\" / a": solution ngram (12 of 20 n-grams)'
    assert item_of(match.detail()) == 'task "7" / a'
    assert item_of("cluster=abc") is None


def test_benchmark_files_in_jsonl_and_parquet_with_a_field_mapping(tmp_path: Path) -> None:
    records = [{"task_id": 11, "text": "Write a function to remove first and last occurrence of a char.",
                "code": "def remove_Occ(s, ch):\n    return s", "test_list": ["assert remove_Occ('hello', 'l') == 'heo'"]}]
    jsonl = tmp_path / "mbpp.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    parquet = tmp_path / "mbpp.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    fields = {"id": "task_id", "prompt": "text", "solution": "code", "tests": "test_list"}
    expected = [BenchmarkItem("mbpp", "11", records[0]["text"], records[0]["code"], records[0]["test_list"][0])]
    assert read_items("mbpp", jsonl, fields) == read_items("mbpp", parquet, fields) == expected
    assert read_items("mbpp", jsonl, {**fields, "tests": None})[0].tests == ""


@pytest.mark.parametrize(("content", "message"), [
    ('{"id": "a", "prompt": "x"}\nnot json\n', "bad.jsonl:2: not a JSON object"),
    ('{"prompt": "x"}\n', "bad.jsonl:1: no id field 'id'"),
    ('{"id": "a"}\n{"id": "a"}\n', "bad.jsonl:2: item id 'a' repeats in benchmark 'b'"),
    ('{"id": "a", "prompt": 3}\n', "bad.jsonl:1: field 'prompt' holds int"),
    ('[1, 2]\n', "bad.jsonl:1: expected a JSON object, got list"),
    ("\n", "bad.jsonl: benchmark file 'b' holds no item"),
])
def test_malformed_benchmark_files_name_the_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DecontaminationError, match=message):
        read_items("b", path, FIELDS)


def test_missing_and_unknown_benchmark_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DecontaminationError, match=f"{tmp_path}/gone.jsonl: benchmark file 'b' not found"):
        read_items("b", tmp_path / "gone.jsonl", FIELDS)
    (tmp_path / "items.csv").write_text("id,prompt\n")
    with pytest.raises(DecontaminationError, match="items.csv: unknown benchmark file type"):
        read_items("b", tmp_path / "items.csv", FIELDS)
