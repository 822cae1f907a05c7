"""Repository-level documents through the tokenize pipeline: one document per repository in dependency order with
file-level FIM, packed whole where it fits, and every token traced back to its file by `inspect --locate`."""

import numpy as np
import pytest
import yaml

from ember.pipelines.code.repo_tokens import file_token, repository_tokens
from ember.pipelines.code.repos import RepoFile, repository_id
from ember.pipelines.locate import locate_text
from ember.schemas import read_manifest
from ember.schemas.documents import Document
from ember.tokenize import fim
from ember.tokenize.config import FimSettings, RepositorySettings, TokenizerConfig
from ember.tokenize.tokenizers import load_tokenizer
from tests.pipelines.test_tokenize_pipeline import invoke, read_rows
from tests.tokenize.support import code_documents, train_tokenizer, write_documents

SEQ_LEN = 1024
FIM = {"rate": 0.5, "spm_rate": 0.5, "level": "file", "seed": 2,
       "prefix_token": "<fim_prefix>", "middle_token": "<fim_middle>", "suffix_token": "<fim_suffix>"}


def repositories() -> dict[str, dict[str, str]]:
    """Eight small repositories whose modules import each other in a cycle, and one large one (longer than L)."""
    source = code_documents()
    repos = {}
    for r in range(8):
        repos[f"org/r{r}"] = {
            "pkg/a.py": f"from pkg import b\n{source[r % 5][100 * r:300 + 140 * r]}",
            "pkg/b.py": f"from pkg import c\n{source[(r + 1) % 5][90 * r:90 * r + 150]}",
            "pkg/c.py": f"import pkg.a\n{source[(r + 2) % 5][80 * r:80 * r + 120]}",
            "run.py": f"from pkg.a import run\n# repo {r}\n",
        }
    repos["org/big"] = {f"m{i}.py": text for i, text in enumerate(source[:4])}
    return repos


@pytest.fixture(scope="module")
def repo_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("repos")
    tokenizer_path = train_tokenizer(root / "tokenizer.json", extra_special=[FIM["prefix_token"], FIM["middle_token"], FIM["suffix_token"]])
    docs = [Document(source="code", kind="code", text=text, metadata={"repo": repo, "path": path})
            for repo, files in repositories().items() for path, text in files.items()]
    loose = [Document(source="code", kind="code", text=f"print({i})  # a file with no repository\n") for i in range(3)]
    write_documents(root / "code" / "part-0.parquet", [*docs, *loose])
    tokenizer = {"kind": "huggingface", "path": str(tokenizer_path), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    config = {"output_dir": "out", "seq_len": SEQ_LEN, "sequences_per_shard": 8, "seed": 1, "tokenizer": tokenizer,
              "sources": [{"name": "code", "path": "code/*.parquet"}], "fim": FIM, "repositories": {"order": "dependency"}}
    (root / "repos.yaml").write_text(yaml.safe_dump(config))
    code, output = invoke("corpus", "tokenize", root / "repos.yaml")
    assert code == 0, output
    return {"out": root / "out", "docs": docs, "loose": loose, "tokenizer": load_tokenizer(TokenizerConfig(**tokenizer))}


def pieces(directory):
    by_doc: dict[str, dict[int, list[int]]] = {}
    rows_of: dict[str, set[int]] = {}
    for n, row in enumerate(read_rows(directory)):
        for lo, hi, segment in zip(row["cu_seqlens"], row["cu_seqlens"][1:], row["segments"]):
            by_doc.setdefault(segment["document_id"], {})[segment["doc_token_start"]] = row["tokens"][lo:hi]
            rows_of.setdefault(segment["document_id"], set()).add(n)
    return {d: [t for _, p in sorted(ps.items()) for t in p] for d, ps in by_doc.items()}, rows_of


def test_one_document_per_repository_in_dependency_order_packed_whole_where_it_fits(repo_set):
    documents, rows_of = pieces(repo_set["out"])
    tokenizer = repo_set["tokenizer"]
    settings, fim_settings = RepositorySettings(), FimSettings(**FIM)
    ids = fim.resolve_ids(fim_settings, tokenizer)
    expected_ids = {repository_id("code", repo) for repo in repositories()} | {d.id for d in repo_set["loose"]}
    assert set(documents) == expected_ids
    for repo, files in repositories().items():
        repo_files = [RepoFile(d.id, d.metadata["path"], d.text) for d in repo_set["docs"] if d.metadata["repo"] == repo]
        built = repository_tokens("code", repo, repo_files, settings, tokenizer, fim_settings, ids)
        tokens = documents[repository_id("code", repo)]
        assert tokens == built.tokens.tolist()
        assert sorted(f.document_id for f in built.files) == sorted(f.document_id for f in repo_files)  # each file once
        paths = [next(f.path for f in repo_files if f.document_id == p.document_id) for p in built.files]
        if repo != "org/big":
            assert paths == ["pkg/a.py", "pkg/c.py", "pkg/b.py", "run.py"]  # the cycle broken at a (ties go to the smaller path)
        for f in built.files:  # every file's tokens un-FIM to its own encoding
            own = tokenizer.encode_ordinary([next(x.text for x in repo_files if x.document_id == f.document_id)])[0]
            assert fim.unfim(np.array(tokens[f.start:f.end], dtype=np.uint32), ids, 0, 0).tolist() == own
        assert (len(rows_of[repository_id("code", repo)]) == 1) == (len(tokens) <= SEQ_LEN)  # split only when longer
    assert len(documents[repository_id("code", "org/big")]) > SEQ_LEN
    assert read_manifest(repo_set["out"]).model_extra["repositories"]["order"] == "dependency"


def test_locate_traces_a_repository_token_to_its_file_and_characters(repo_set):
    manifest = read_manifest(repo_set["out"])
    shard = repo_set["out"] / manifest.shards[0].path
    texts = {d.id: d.text for d in repo_set["docs"]}
    documents, _ = pieces(repo_set["out"])
    tokenizer = repo_set["tokenizer"]
    fim_settings = FimSettings(**FIM)
    ids = fim.resolve_ids(fim_settings, tokenizer)
    found_files, headers = set(), 0
    for repo in ("org/r0", "org/r3"):
        doc = repository_id("code", repo)
        repo_files = [RepoFile(d.id, d.metadata["path"], d.text) for d in repo_set["docs"] if d.metadata["repo"] == repo]
        built = repository_tokens("code", repo, repo_files, RepositorySettings(), tokenizer, fim_settings, ids)
        for index in range(0, len(documents[doc]), 5):
            where = locate_text(shard, "code", doc, index)
            traced = file_token(built, index, fim_settings, 0, 1)
            if traced is None:  # a header, the EOS or a FIM sentinel
                headers += 1
                assert where.span is None
                continue
            file_id, within = traced
            assert tokenizer.encode_ordinary([texts[file_id]])[0][within] == documents[doc][index]  # the token, exactly
            assert where.document_id == file_id and where.origin.startswith(repo)
            start, end = where.span  # char_span's binary search over prefixes can cut a merged BPE token short
            assert texts[file_id][start:end] == where.token_text and end > start
            assert len(tokenizer.encode_ordinary([texts[file_id][:start]])[0]) <= within + 1
            found_files.add(file_id)
    assert headers and len(found_files) == 8
