"""FIM at tokenize time, end to end: every FIM'd document un-FIMs to the tokenizer's own tokens, the manifest
records the settings, `inspect --locate` finds a FIM'd token's characters, and missing FIM tokens are refused."""

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer as HFTokenizer

from ember.pipelines.locate import locate_text
from ember.schemas import read_manifest
from ember.schemas.documents import Document
from ember.tokenize import fim
from tests.pipelines.test_tokenize_pipeline import invoke, read_rows
from tests.tokenize.support import code_documents, train_tokenizer, write_documents

FIM_TOKENS = {"prefix_token": "<fim_prefix>", "middle_token": "<fim_middle>", "suffix_token": "<fim_suffix>"}
SEQ_LEN = 512


@pytest.fixture(scope="module")
def fim_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("fim")
    tokenizer = train_tokenizer(root / "tokenizer.json", extra_special=list(FIM_TOKENS.values()))
    docs = [Document(source="code", kind="code", text=f"# part {i}\n{text[i * 300:(i + 1) * 300 + 900]}",
                     metadata={"repo": "py/json", "path": f"json/{i}.py"})
            for i, text in enumerate(code_documents() * 8) if text[i * 300:]]
    write_documents(root / "code" / "part-0.parquet", docs)
    config = {
        "output_dir": "out", "seq_len": SEQ_LEN, "sequences_per_shard": 8, "seed": 3,
        "tokenizer": {"kind": "huggingface", "path": str(tokenizer), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "sources": [{"name": "code", "path": "code/*.parquet"}],
        "fim": {"rate": 0.5, "spm_rate": 0.5, "seed": 7, **FIM_TOKENS},
    }
    (root / "fim.yaml").write_text(yaml.safe_dump(config))
    code, output = invoke("corpus", "tokenize", root / "fim.yaml")
    assert code == 0, output
    library = HFTokenizer.from_file(str(tokenizer))
    library.encode_special_tokens = True
    ids = fim.FimIds(*(library.token_to_id(FIM_TOKENS[k]) for k in ("prefix_token", "middle_token", "suffix_token")))
    eos = library.token_to_id("<|endoftext|>")
    plain = {d.id: [*library.encode(d.text, add_special_tokens=False).ids, eos] for d in docs}
    return {"root": root, "out": root / "out", "plain": plain, "ids": ids, "texts": {d.id: d.text for d in docs}}


def rebuilt_documents(directory) -> dict[str, list[int]]:
    pieces: dict[str, list[tuple[int, list[int]]]] = {}
    for row in read_rows(directory):
        for lo, hi, segment in zip(row["cu_seqlens"], row["cu_seqlens"][1:], row["segments"]):
            pieces.setdefault(segment["document_id"], []).append((segment["doc_token_start"], row["tokens"][lo:hi]))
    return {doc: [t for _, part in sorted(parts) for t in part] for doc, parts in pieces.items()}


def test_every_fimmed_document_unfims_to_the_original_and_the_rate_is_binomial(fim_set):
    rebuilt = rebuilt_documents(fim_set["out"])
    assert set(rebuilt) == set(fim_set["plain"])
    fimmed = 0
    for doc_id, tokens in rebuilt.items():
        array = np.array(tokens, dtype=np.uint32)
        if fim_set["ids"].prefix in tokens:
            fimmed += 1
            assert len(tokens) == len(fim_set["plain"][doc_id]) + 3
        assert fim.unfim(array, fim_set["ids"], 0, 1).tolist() == fim_set["plain"][doc_id], doc_id
    n = len(rebuilt)
    assert abs(fimmed - n / 2) <= 5 * (n / 4) ** 0.5 + 1, (fimmed, n)
    manifest = read_manifest(fim_set["out"])
    assert manifest.model_extra["fim"] == {"rate": 0.5, "spm_rate": 0.5, "level": "file", "seed": 7, **FIM_TOKENS}
    assert manifest.sources["code"].tokens == sum(len(t) for t in rebuilt.values())


def test_locate_finds_the_characters_of_a_fimmed_token(fim_set):
    shard = fim_set["out"] / read_manifest(fim_set["out"]).shards[0].path
    checked = 0
    for row in list(read_rows(fim_set["out"]))[:4]:
        for lo, hi, segment in zip(row["cu_seqlens"], row["cu_seqlens"][1:], row["segments"]):
            doc = segment["document_id"]
            for position in range(lo, hi, 37):
                index = segment["doc_token_start"] + position - lo
                found = locate_text(shard, "code", doc, index)
                if found.framing == "FIM":
                    assert row["tokens"][position] in (fim_set["ids"].prefix, fim_set["ids"].middle, fim_set["ids"].suffix)
                    continue
                if found.framing == "EOS":
                    continue
                layout = fim.layout(doc, len(fim_set["plain"][doc]), 0, 1, 0.5, 0.5, 7)
                plain = fim.source_index(layout, index) if layout.mode else index
                assert fim_set["plain"][doc][plain] == row["tokens"][position]
                start, end = found.span
                assert fim_set["texts"][doc][start:end] == found.token_text and end > start
                checked += 1
    assert checked > 20


def test_a_tokenizer_without_the_fim_tokens_is_refused_before_any_work(fim_set, hf_tokenizer_path):
    config = yaml.safe_load((fim_set["root"] / "fim.yaml").read_text())
    config["tokenizer"]["path"] = str(hf_tokenizer_path)
    config["output_dir"] = "refused"
    (fim_set["root"] / "refused.yaml").write_text(yaml.safe_dump(config))
    code, output = invoke("corpus", "tokenize", fim_set["root"] / "refused.yaml")
    assert code == 2 and "fim.prefix_token: '<fim_prefix>' is not a token of" in output, output
    assert not (fim_set["root"] / "refused").exists()
