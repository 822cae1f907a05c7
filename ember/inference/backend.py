"""The sampler's backend seam: whichever engine samples, the worker gets the same record per completion.

Two engines stand behind it. transformers in this process (`worker.Sampler` over `generate.generate`) records
everything the trainer can use, the routed experts included. An OpenAI-compatible server (`http_backend`:
vLLM, SGLang) records what its responses carry: token ids and the sampled tokens' log-probs, and no routed
experts (`experts` is None; the ETL batches such rollouts apart and the trainer steps on them without replay).

No torch, Kafka or Beam here (import-linter holds it): the HTTP backend must not pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    eos_id: int | None
    pad_id: int
    seed: int = 0  # an HTTP engine's per-request seed is this plus the request's index in the run


@dataclass(frozen=True)
class Completion:
    tokens: np.ndarray  # uint32 [n]: prompt then completion
    prompt_tokens: int
    logprobs: np.ndarray  # float32 [n], 0 on the prompt
    experts: np.ndarray | None  # uint8|uint16 [n, layers, top_k]; None: the engine cannot report its routing
    finish_reason: str  # "stop": the eos token was sampled; "length": max_new_tokens ran out
    first_version: int  # the policy version that sampled its first token
    last_version: int  # ... and its last


class Backend(Protocol):
    """Generates one completion per prompt. An entry that is a string is the one-line reason that completion
    could not be had (the worker drops its whole group and counts it); an engine that cannot be used at all
    raises instead."""

    def generate(self, prompts: list[list[int]], texts: list[str], sampling: Sampling) -> list[Completion | str]: ...

    def follow(self) -> int | None:
        """Before a batch: take up a newer announced policy version where this backend follows them, and say which
        version the batch will start under (the worker's per-version budget counts against it). None: the engine
        holds weights its operator loads, so no budget applies."""
        ...
