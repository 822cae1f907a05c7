"""The tokenize-and-pack pipeline end to end on Beam's FnApiRunner, checked against the tokenizer itself."""

import json
import re
import shutil

import numpy as np
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer as HFTokenizer
from typer.testing import CliRunner

from ember.cli import app
from ember.schemas import read_manifest
from ember.schemas.documents import Document
from ember.schemas.shards import packed_sequence_issues
from ember.tokenize.shardset import verify_shard_set
from tests.pipelines.corpus_support import file_digests
from tests.tokenize.support import mixed_documents, write_documents

SEQ_LEN = 256


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, hf_tokenizer_path):
    """Mixed code + web Parquet, plus one empty document, one repeated id and one row in the wrong source."""
    root = tmp_path_factory.mktemp("corpus")
    docs = mixed_documents()
    empty = Document(source="web", kind="web", text="")
    stray = Document(source="web", kind="web", text="a web page filed under code")
    write_documents(root / "code" / "part-0.parquet", [*docs["code"], stray])
    write_documents(root / "web" / "part-0.parquet", docs["web"][:30])
    write_documents(root / "web" / "part-1.parquet", [*docs["web"][30:], empty, docs["web"][3]])
    return {"root": root, "docs": docs, "tokenizer": hf_tokenizer_path}


def write_config(corpus, name: str, **overrides):
    config = {
        "output_dir": f"out-{name}",
        "seq_len": SEQ_LEN,
        "window_documents": 16,
        "sequences_per_shard": 10,
        "rows_per_batch": 4,
        "seed": 11,
        "tokenizer": {"kind": "huggingface", "path": str(corpus["tokenizer"]), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "sources": [
            {"name": "code", "path": "code/*.parquet", "weight": 0.7},
            {"name": "web", "path": "web/*.parquet", "weight": 0.3},
        ],
        **overrides,
    }
    path = corpus["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def built(corpus):
    code, output = invoke("corpus", "tokenize", write_config(corpus, "best"))
    assert code == 0, output
    return corpus["root"] / "out-best"


def reference_tokens(corpus) -> dict[str, list[int]]:
    """What the tokenizer library itself produces for every accepted document, plus the EOS policy."""
    library = HFTokenizer.from_file(str(corpus["tokenizer"]))
    library.encode_special_tokens = True
    eos = library.token_to_id("<|endoftext|>")
    docs = [d for source in corpus["docs"].values() for d in source]
    return {d.id: [*library.encode(d.text, add_special_tokens=False).ids, eos] for d in docs}


def read_rows(directory):
    manifest = read_manifest(directory)
    for entry in manifest.shards:
        with ipc.open_file(directory / entry.path) as reader:
            yield from reader.read_all().to_pylist()


def test_every_document_token_lands_exactly_once(built, corpus):
    assert verify_shard_set(built) == []
    expected = reference_tokens(corpus)
    rebuilt = {doc_id: np.full(len(ids), -1, dtype=np.int64) for doc_id, ids in expected.items()}
    source_of = {d.id: s for s, docs in corpus["docs"].items() for d in docs}
    for row in read_rows(built):
        tokens = np.array(row["tokens"])
        assert packed_sequence_issues(tokens, np.array(row["cu_seqlens"]), row["segments"], SEQ_LEN) == []
        for lo, hi, segment in zip(row["cu_seqlens"], row["cu_seqlens"][1:], row["segments"]):
            assert source_of[segment["document_id"]] == row["source"]  # packing is per source
            target = rebuilt[segment["document_id"]][segment["doc_token_start"] : segment["doc_token_end"]]
            assert np.all(target == -1), "a document token appears twice"
            target[:] = tokens[lo:hi]
        assert np.all(tokens[row["cu_seqlens"][-1] :] == 2)  # <|pad|>
    for doc_id, ids in expected.items():
        assert rebuilt[doc_id].tolist() == ids, doc_id


def test_manifest_accounts_for_tokens_padding_and_rejects(built, corpus):
    manifest = read_manifest(built)
    expected = reference_tokens(corpus)
    for source, docs in corpus["docs"].items():
        stats = manifest.sources[source]
        assert stats.documents == len(docs)
        assert stats.tokens == sum(len(expected[d.id]) for d in docs)
        assert stats.sequences * SEQ_LEN == stats.tokens + stats.padding_tokens
        assert stats.split_documents == sum(1 for d in docs if len(expected[d.id]) > SEQ_LEN)  # only those
    assert manifest.model_extra["rejected"] == {
        "code": {"source_mismatch": 1},
        "web": {"duplicate_document_id": 1, "empty_after_tokenization": 1},
    }
    rejected = pq.read_table(built / "rejected.parquet").to_pylist()
    assert sorted(r["reason"] for r in rejected) == ["duplicate_document_id", "empty_after_tokenization", "source_mismatch"]
    assert manifest.sources["code"].mixture_weight == 0.7
    assert [s.rows for s in manifest.shards][:-1] == [10] * (len(manifest.shards) - 1)
    assert manifest.tokenizer.vocab_size == 600 and manifest.dtype == "uint16"


def test_rerun_with_other_parallelism_gives_identical_output(built, corpus):
    code, output = invoke(
        "corpus", "tokenize", write_config(corpus, "rerun"), "--direct_num_workers=2", "--direct_running_mode=multi_threading"
    )
    assert code == 0, output
    first, second = (json.loads((d / "manifest.json").read_text()) for d in (built, corpus["root"] / "out-rerun"))
    assert first.pop("created_at") and second.pop("created_at")
    assert first == second
    for entry in first["shards"]:
        assert (built / entry["path"]).read_bytes() == (corpus["root"] / "out-rerun" / entry["path"]).read_bytes()


def test_global_shuffle_mixes_sources_across_shards(built):
    sources_per_shard = []
    for entry in read_manifest(built).shards:
        with ipc.open_file(built / entry.path) as reader:
            sources_per_shard.append(set(reader.read_all().column("source").to_pylist()))
    assert sum(1 for s in sources_per_shard if s == {"code", "web"}) >= len(sources_per_shard) // 2


def test_locate_maps_a_training_token_to_its_document(built, corpus):
    expected = reference_tokens(corpus)
    shard = built / read_manifest(built).shards[1].path
    with ipc.open_file(shard) as reader:
        row = reader.read_all().slice(3, 1).to_pylist()[0]
    position = row["cu_seqlens"][1] + 1 if len(row["cu_seqlens"]) > 2 else 5
    code, output = invoke("corpus", "inspect", "--locate", shard, 3, position)
    assert code == 0, output
    doc_id, index = re.search(r"document (\S+) token (\d+)", output).groups()
    assert expected[doc_id][int(index)] == row["tokens"][position]
    assert "text around characters [" in output, "documents without metadata still show their text"
    if row["cu_seqlens"][-1] < SEQ_LEN:
        code, output = invoke("corpus", "inspect", "--locate", shard, 3, SEQ_LEN - 1)
        assert code == 0 and "padding" in output


def test_export_of_the_build_reads_back_in_megatron(built, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    code, output = invoke("export", "megatron", built, tmp_path / "corpus")
    assert code == 0, output
    dataset = IndexedDataset(str(tmp_path / "corpus"))
    rows = list(read_rows(built))
    assert len(dataset) == len(rows)
    for i, row in enumerate(rows):
        assert dataset[i].tolist() == row["tokens"]


def test_documents_export_of_the_build_equals_the_tokenizer_per_document(built, corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    code, output = invoke("export", "megatron", "--documents", built, tmp_path / "docs")
    assert code == 0 and "left out" not in output, output
    expected = reference_tokens(corpus)
    order = [s["document_id"] for row in read_rows(built) for s in row["segments"] if s["doc_token_start"] == 0]
    dataset = IndexedDataset(str(tmp_path / "docs"))
    assert len(dataset) == len(order) == len(expected) and set(order) == set(expected)
    for i, doc_id in enumerate(order):
        assert dataset[i].tolist() == expected[doc_id], doc_id  # split ones rejoined, padding dropped
    manifest = read_manifest(built)
    assert manifest.model_extra["framing"]["eos_token_id"] == HFTokenizer.from_file(str(corpus["tokenizer"])).token_to_id("<|endoftext|>")
    assert manifest.tokenizer.source == f"file {corpus['tokenizer']}" and len(manifest.tokenizer.file_sha256) == 64


def test_concat_and_chunk_splits_more_documents(built, corpus):
    code, output = invoke("corpus", "tokenize", write_config(corpus, "chunk", packing="concat_chunk"))
    assert code == 0, output
    chunk, best = read_manifest(corpus["root"] / "out-chunk"), read_manifest(built)
    assert verify_shard_set(corpus["root"] / "out-chunk") == []
    for source in ("code", "web"):
        assert chunk.sources[source].tokens == best.sources[source].tokens
        assert chunk.sources[source].split_documents >= best.sources[source].split_documents
    # every code file is longer than L (both split all of them); short web pages show the difference
    assert chunk.sources["web"].split_documents > best.sources["web"].split_documents


def test_bad_input_gives_a_clear_error(corpus, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    cases = [
        ({"tokenizer": {"kind": "huggingface", "path": str(broken), "eos_token": "<|endoftext|>"}}, "not a loadable Hugging Face tokenizer.json"),
        ({"tokenizer": {"kind": "huggingface", "path": str(corpus["tokenizer"]), "eos_token": "<|eos|>"}}, "tokenizer.eos_token: '<|eos|>' is not a token"),
        ({"sources": [{"name": "code", "path": "nothing/*.parquet"}]}, "sources.0.path: no file matches"),
        ({"output_dir": "out-best"}, "is not empty"),
        ({"seq_len": 0}, "seq_len: Input should be greater than or equal to 2"),
    ]
    for number, (overrides, message) in enumerate(cases):
        code, output = invoke("corpus", "tokenize", write_config(corpus, f"bad{number}", **overrides))
        assert code == 2 and message in output, output


def staging_leftovers(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_overwrite_refuses_files_the_manifest_does_not_list(built, corpus, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built, out)
    (out / "shard-000099.arrow").write_bytes(b"named like a shard, listed in no manifest")
    (out / "notes.txt").write_text("mine")
    before = file_digests(out)
    code, output = invoke("corpus", "tokenize", write_config(corpus, "foreign", output_dir=str(out)), "--overwrite")
    assert code == 2, output
    assert "holds 2 file(s) ember did not write there: notes.txt, shard-000099.arrow" in output
    assert "nothing was changed" in output
    assert file_digests(out) == before and staging_leftovers(out) == []


def test_a_failed_overwrite_keeps_the_previous_set_and_a_finished_one_replaces_it(built, corpus, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built, out)
    before = file_digests(out)
    write_documents(tmp_path / "empty" / "part-0.parquet", [Document(source="web", kind="web", text="")])
    failing = write_config(corpus, "failing", output_dir=str(out), sources=[{"name": "web", "path": f"{tmp_path}/empty/*.parquet"}])
    result = CliRunner().invoke(app, ["corpus", "tokenize", str(failing), "--overwrite"])
    assert result.exit_code != 0 and "no document survived tokenization" in str(result.exception)
    assert file_digests(out) == before and verify_shard_set(out) == [] and staging_leftovers(out) == []
    code, output = invoke("corpus", "tokenize", write_config(corpus, "again", output_dir=str(out)), "--overwrite")
    assert code == 0, output
    assert verify_shard_set(out) == [] and staging_leftovers(out) == []
    after = file_digests(out)
    assert after.keys() == before.keys()
    assert json.loads((out / "manifest.json").read_text())["created_at"] != json.loads((built / "manifest.json").read_text())["created_at"]
    assert {k: v for k, v in after.items() if k.startswith("shard-")} == {k: v for k, v in before.items() if k.startswith("shard-")}


def test_an_output_short_of_free_space_is_refused_before_the_pipeline(corpus, tmp_path):
    out = tmp_path / "deep" / "out"
    code, output = invoke("corpus", "tokenize", write_config(corpus, "full", output_dir=str(out)), "--min-free-mb", 10**12)
    assert code == 2 and "MiB free, the build needs at least" in output and "Traceback" not in output, output
    assert not out.exists() and staging_leftovers(out) == []


def test_blend_export_is_read_by_megatron_in_the_weights_share(built, tmp_path):
    """The --per-split-data-args-path JSON and the --data-path words, parsed by megatron-core's own reader and built by
    its BlendedMegatronDatasetBuilder, draw each source in its weight's share."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    code, output = invoke("export", "megatron", "--blend", built, tmp_path / "mix")
    assert code == 0, output
    per_split = json.loads((tmp_path / "mix.per-split.json").read_text())
    blend = get_blend_from_list(per_split["train"])  # what --per-split-data-args-path parses, split by split
    assert blend == get_blend_from_list((tmp_path / "mix.data-path.txt").read_text().split())
    assert [p.rsplit(".", 1)[1] for p in blend[0]] == ["code", "web"] and blend[1] == [0.7, 0.3]
    manifest = read_manifest(built)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=SEQ_LEN - 1, blend_per_split=[blend, None, None], path_to_cache=str(tmp_path / "cache"),
        tokenizer=NullTokenizer(manifest.tokenizer.vocab_size), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
    )
    samples = 2000
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, config).build()
    drawn = np.bincount(train.dataset_index, minlength=2)
    assert len(train) == samples
    assert abs(drawn[0] / samples - 0.7) < 0.02, drawn  # BlendedDataset interleaves by error, not by chance
    for i, source in enumerate(("code", "web")):  # each prefix holds its source's rows, in shard order
        rows = train.datasets[i].dataset
        assert [rows[j].tolist() for j in range(len(rows))] == [r["tokens"] for r in read_rows(built) if r["source"] == source]


def test_token_budgets_repeat_and_sample_documents_by_seeded_ids(built, corpus):
    """code gets twice and a half its tokens (2 copies of each document, a third for about half), web a budget of a
    third of its tokens; the manifest records target against realised, and every copy is the document's tokens."""
    plain = read_manifest(built)
    budgets = {"code": int(plain.sources["code"].tokens * 2.5), "web": plain.sources["web"].tokens // 3}
    code, output = invoke("corpus", "tokenize", write_config(corpus, "mix", mixture={"budgets": budgets, "seed": 4}))
    assert code == 0, output
    assert "target" in output and str(budgets["code"]) in output  # the summary: target against realised
    out = corpus["root"] / "out-mix"
    assert verify_shard_set(out) == []
    manifest = read_manifest(out)
    expected = reference_tokens(corpus)
    seen: dict[str, dict[str, list[int]]] = {}
    for row in read_rows(out):
        for lo, hi, segment in zip(row["cu_seqlens"], row["cu_seqlens"][1:], row["segments"]):
            seen.setdefault(segment["document_id"], {})[segment["doc_token_start"]] = row["tokens"][lo:hi]
    copies: dict[str, int] = {}
    for name, pieces in seen.items():
        base = re.sub(r"#copy\d+$", "", name)
        assert [t for _, part in sorted(pieces.items()) for t in part] == expected[base], name
        copies[base] = copies.get(base, 0) + 1
    code_docs = [d.id for d in corpus["docs"]["code"]]
    assert all(copies[d] in (2, 3) for d in code_docs) and any(copies[d] == 3 for d in code_docs)
    assert all(copies.get(d.id, 0) in (0, 1) for d in corpus["docs"]["web"])
    for source, target in budgets.items():
        stats = manifest.sources[source].model_dump()
        assert stats["target_tokens"] == target
        # planned before packing drops a repeated id (web holds one): its tokens are counted in what is available
        assert stats["available_tokens"] - plain.sources[source].tokens == (0 if source == "code" else len(expected[corpus["docs"]["web"][3].id]))
        assert abs(stats["tokens"] - target) < 0.35 * target, (source, stats["tokens"], target)  # a seeded draw
    assert manifest.model_extra["mixture"]["budgets"] == budgets
    assert manifest.sources["code"].model_dump()["repeats"] == 2
    from ember.pipelines.corpus.report_html import mixture_rows

    assert [r[:3] for r in mixture_rows(str(out))] == [[s, budgets[s], manifest.sources[s].tokens] for s in ("code", "web")]


def test_of_a_repeated_id_the_copy_with_fewest_then_smallest_tokens_is_kept(corpus, tmp_path):
    """Copies of one id in different files (different tokenizer batches) that tie on length are told apart by their
    tokens, where they meet in the shard writer; a longer copy never wins."""
    library = HFTokenizer.from_file(str(corpus["tokenizer"]))
    library.encode_special_tokens = True
    eos = library.token_to_id("<|endoftext|>")
    texts = ["y", "x", "x y z"]  # two one-token texts and a longer one, all under one id
    for i, text in enumerate(texts):
        write_documents(tmp_path / "web" / f"part-{i}.parquet", [Document(source="web", kind="web", text=text, id="same")])
    framed = [np.array([*library.encode(t, add_special_tokens=False).ids, eos], dtype="<u4") for t in texts]
    assert len(framed[0]) == len(framed[1]) < len(framed[2])
    config = write_config(corpus, "repeated", sources=[{"name": "web", "path": str(tmp_path / "web" / "*.parquet"), "weight": 1.0}])
    code, output = invoke("corpus", "tokenize", config)
    assert code == 0, output
    rows = list(read_rows(corpus["root"] / "out-repeated"))
    assert len(rows) == 1 and [s["document_id"] for s in rows[0]["segments"]] == ["same"]
    kept = rows[0]["tokens"][: rows[0]["cu_seqlens"][-1]]
    assert kept == min(framed[:2], key=lambda t: t.tobytes()).tolist()
    assert read_manifest(corpus["root"] / "out-repeated").model_extra["rejected"] == {"web": {"duplicate_document_id": 2}}
