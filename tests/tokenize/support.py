"""Test inputs built on the fly: a small byte-level BPE trained here, and a mixed code + web corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ember.schemas.documents import Document, documents_to_table

SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>"]

WEB = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Ünïcödé façade, naïve café — “quotes” and ‘apostrophes’… 日本語のテキスト、中文文本，한국어 텍스트.",
    "Emoji 🎉🚀👩‍💻 and combining marks: e\u0301 a\u0308 \u0915\u094d\u0937, RTL: שלום עולם مرحبا بالعالم",
    "A page quoting <|endoftext|> in the middle, and <|bos|> too, plus <|pad|><|endoftext|> glued.",
    "Half look-alikes: <|endoftext, endoftext|>, <| endoftext |>, <|ENDOFTEXT|>.",
    "Tabs\tand\r\nwindows line ends\r\n\r\nand trailing spaces   \n",
]


def code_documents() -> list[str]:
    """Real Python source: the standard library's json package, one document per file."""
    package = Path(json.__file__).parent
    return [p.read_text() for p in sorted(package.glob("*.py"))]


def exactness_corpus() -> list[str]:
    long_line = "x = [" + ", ".join(str(i) for i in range(40_000)) + "]"  # ~260k characters, one line
    return [*code_documents(), *WEB, long_line, "a", " ", "\n\n\n", "<|endoftext|>"]


def train_tokenizer(path: Path, vocab_size: int = 600, extra_special: list[str] = ()) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*code_documents(), *WEB], trainer)
    tokenizer.save(str(path))
    return path


def write_documents(path: Path, documents: list[Document], row_group_size: int = 7) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(documents_to_table(documents), path, row_group_size=row_group_size)
    return path


def mixed_documents(copies: int = 3) -> dict[str, list[Document]]:
    """Code and web sources with long-tailed lengths; every text distinct so ids are unique."""
    code = [
        Document(source="code", kind="code", text=f"# copy {c}\n{text}", metadata={"path": f"json/{i}.py"})
        for c in range(copies)
        for i, text in enumerate(code_documents())
    ]
    web = [
        Document(source="web", kind="web", text=f"{text} (page {c}.{i}) " * (1 + (i * 7 + c) % 23))
        for c in range(copies * 4)
        for i, text in enumerate(WEB)
    ]
    return {"code": code, "web": web}


@pytest.fixture(scope="session")
def hf_tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE trained here on the test corpus (no model hub is reachable)."""
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")
