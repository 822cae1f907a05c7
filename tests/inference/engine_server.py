"""An OpenAI-compatible completions server that answers as vLLM does with `logprobs` and `return_token_ids`
(`choices[0].token_ids`, `prompt_token_ids`, `logprobs.token_logprobs`), sampling with ember's transformers sampler.

Why it exists: no vLLM or SGLang can run on this machine (no GPU, no wheels), and the one real server here,
`transformers serve`, returns neither token ids nor log-probs (tests/inference/test_http_backend.py shows it).
The HTTP backend's success path still needs a server that returns both; this one returns real samples of the
exported policy, so the test can recompute every log-prob with transformers' own forward pass.

`corrupt_prompts`: requests whose prompt is one of these answer a positive log-prob, as a broken engine would.
"""

from __future__ import annotations

import threading
import time

import torch
import uvicorn
from fastapi import FastAPI

from ember.inference.backend import Sampling
from ember.inference.generate import generate
from ember.inference.policy import LoadedPolicy
from tests.rollouts.grading.judge_server import free_port


class EngineServer:
    def __init__(self, policy: LoadedPolicy, model: str, eos_id: int | None, pad_id: int, corrupt_prompts: list[list[int]]):
        self.policy, self.model, self.eos_id, self.pad_id = policy, model, eos_id, pad_id
        self.corrupt = [list(p) for p in corrupt_prompts]
        self.requests: list[dict] = []
        self.lock = threading.Lock()  # one generation at a time: the model is not shared across threads
        app = FastAPI()
        app.post("/v1/completions")(self._complete)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def _complete(self, body: dict) -> dict:
        self.requests.append(body)
        prompt = body["prompt"]
        sampling = Sampling(float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)), int(body["max_tokens"]),
                            eos_id=self.eos_id, pad_id=self.pad_id)
        with self.lock:
            (done,) = generate(self.policy, [prompt], sampling, torch.Generator().manual_seed(int(body.get("seed", 0))))
        ids = done.tokens[done.prompt_tokens :].tolist()
        logprobs = done.logprobs[done.prompt_tokens :].tolist()
        if prompt in self.corrupt:
            logprobs[0] = 0.5
        choice = {"index": 0, "text": "", "finish_reason": done.finish_reason,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs, "top_logprobs": [], "text_offset": []}}
        if body.get("return_token_ids"):
            choice |= {"token_ids": ids, "prompt_token_ids": prompt}
        return {"id": f"cmpl-{len(self.requests)}", "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}}

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
