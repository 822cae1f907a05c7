"""A real OpenAI-compatible server for the judge's tests: `transformers serve` (Hugging Face's, not ember's) hosting
a tiny random Llama built here with transformers' own classes, since no model hub is reachable.

Its answers are nonsense, which is what the judge must survive; a request's `logit_bias` (which the server
honours) can still shape an answer into a well-formed score, so the success path runs against it too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.ports import free_port

READY_TIMEOUT_S = 180.0
"""Importing torch and transformers on a loaded 2-core machine takes most of this; the model itself is tiny."""


def build_tiny_model(directory: Path) -> Path:
    """A 2-layer, 32-wide Llama with random weights and a byte-level BPE tokenizer trained on one line."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["rate the answer from 0 to 10: def add(a, b): return a + b"], vocab_size=300, special_tokens=["<s>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


class JudgeServer:
    """`transformers serve` on a free 127.0.0.1 port; its uvicorn access log counts the requests it received."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._proc: subprocess.Popen | None = None

    def token_id(self, text: str) -> int:
        """The id of a one-token text, e.g. a digit, for a logit bias."""
        (token,) = self._tokenizer.encode(text, add_special_tokens=False).ids
        return token

    def start(self) -> None:
        serve = Path(sys.executable).with_name("transformers")
        command = [str(serve), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self._proc.returncode} before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"transformers serve not ready on port {self.port} after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no graceful shutdown, requests in flight are cut."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def chat_requests(self) -> int:
        """Chat requests the server has answered (uvicorn logs a request as its response starts) since the log was created."""
        return self.log_path.read_text(errors="replace").count('"POST /v1/chat/completions')

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
