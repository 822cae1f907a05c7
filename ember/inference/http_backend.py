"""The sampler's HTTP backend: a production engine (vLLM, SGLang) behind the OpenAI-compatible completions API.

Each completion is one `/v1/completions` request with the prompt as token ids, `logprobs` and vLLM's
`return_token_ids`, so the rollout carries exactly the ids the engine saw and sampled, not a re-tokenisation of
its text. A server that cannot return what a rollout needs (the sampled token ids, one log-prob per sampled
token) is refused at the first response with a one-line `HTTPBackendError` that names the missing fields:
guessing them would feed the trainer's importance weights with numbers no engine produced. The routed experts
are never in such a response, so they are None (docs/guides/sampler.md says what the trainer does then).

A request that times out or fails is retried (`retries`, by the openai client, with its backoff); one that still
fails, or whose answer is malformed (ids outside the tokenizer, a positive or missing log-prob), costs its
group, named and counted, never the run.

No Kafka, Beam or torch here (import-linter holds it).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

import numpy as np
import openai
from pydantic import Field

from ember.configs import APIKeySource
from ember.inference.backend import Completion, Sampling

FINISH_REASONS = {"stop", "length"}


class HTTPBackendError(RuntimeError):
    """The server cannot serve as a sampler (it refuses the requests, or its answers lack needed fields)."""


class OpenAIHTTPSettings(APIKeySource):
    """The endpoint of a production engine; no key source: a server without auth."""

    base_url: str = Field(..., pattern=r"^https?://", description="the OpenAI-compatible endpoint, e.g. http://host:8000/v1")
    model: str = Field(..., min_length=1, description="the model name the server serves")
    prompt_as: Literal["token_ids", "text"] = Field(
        "token_ids", description="token_ids (vLLM, SGLang): the engine sees exactly the rollout's prompt; text: for a "
        "server that takes only text, whose echoed prompt_token_ids must then equal the tokenizer's")
    policy_version: int = Field(0, ge=0, description="the policy version of the weights the server holds, stamped on "
                                "its rollouts (the server's operator loads them, not ember)")
    extra_body: dict[str, Any] = Field(
        default_factory=lambda: {"return_token_ids": True}, description="fields added to every request beyond the "
        "OpenAI schema: vLLM's return_token_ids by default; {} for a server that rejects unknown fields")
    timeout_s: float = Field(60.0, gt=0, description="one request's limit; a slower answer is retried")
    retries: int = Field(2, ge=0, le=20, description="retries of a timeout, a connection error, 429 or a server error")
    max_concurrency: int = Field(16, ge=1, le=4096, description="requests in flight at once")

    def api_key(self) -> str:
        """The only place the key is read (as the judge reads its own); it goes straight into the client, never
        into a log or an error. A server without auth still needs a non-empty string in the openai client."""
        return self.read_api_key(HTTPBackendError) or "no-key"


class OpenAIBackend:
    """One completion per request, `max_concurrency` in flight; `version` is stamped on every completion."""

    def __init__(self, settings: OpenAIHTTPSettings, vocab_size: int):
        self.settings, self.vocab_size = settings, vocab_size
        self.key = settings.api_key()
        self.requests = 0  # every request so far: the next one's seed offset

    @property
    def where(self) -> str:
        return f"{self.settings.base_url} ({self.settings.model})"

    def follow(self) -> None:
        """The server's operator swaps its weights, not ember: no version to follow or budget."""
        return None

    def generate(self, prompts: list[list[int]], texts: list[str], sampling: Sampling) -> list[Completion | str]:
        first, self.requests = self.requests, self.requests + len(prompts)
        return asyncio.run(self._all(prompts, texts, sampling, first))

    async def _all(self, prompts: list[list[int]], texts: list[str], sampling: Sampling, first: int) -> list[Completion | str]:
        s = self.settings
        gate = asyncio.Semaphore(s.max_concurrency)
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key=self.key, timeout=s.timeout_s, max_retries=s.retries) as client:
            async def one(i: int) -> Completion | str:
                async with gate:
                    return await self._one(client, prompts[i], texts[i], sampling, first + i)
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def _one(self, client: openai.AsyncOpenAI, prompt: list[int], text: str, sampling: Sampling, request: int) -> Completion | str:
        s = self.settings
        try:
            response = await client.completions.create(
                model=s.model, prompt=prompt if s.prompt_as == "token_ids" else text, max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed + request, logprobs=1,
                extra_body=s.extra_body,
            )
        except (openai.BadRequestError, openai.UnprocessableEntityError) as exc:  # every prompt's request has this shape
            raise HTTPBackendError(f"{self.where} refused the request ({exc.status_code}: {_detail(exc)}); "
                                   f"prompt_as: {s.prompt_as}") from None
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as exc:
            raise HTTPBackendError(f"{self.where}: {exc.status_code} {_detail(exc)}") from None
        except openai.APIError as exc:
            return f"request {request}: {type(exc).__name__} after {s.retries} retries ({_detail(exc)})"
        if not response.choices:
            return f"request {request}: the response has no choices"
        return self._completion(response.choices[0], prompt, request)

    def _completion(self, choice: Any, prompt: list[int], request: int) -> Completion | str:
        """The rollout's fields from one choice; fields the server never sends raise, malformed ones cost the request."""
        extra = choice.model_extra or {}
        token_ids = extra.get("token_ids")
        token_logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        echoed = extra.get("prompt_token_ids")
        missing = [name for name, value in (
            ("the sampled token ids (vLLM: `token_ids` with return_token_ids)", token_ids),
            ("per-token log-probs (`logprobs.token_logprobs`)", token_logprobs),
            *([("the prompt's token ids (`prompt_token_ids`), needed with prompt_as: text", echoed)] if self.settings.prompt_as == "text" else []),
        ) if value is None]
        if missing:
            raise HTTPBackendError(f"{self.where} answered without {' and without '.join(missing)}: a rollout needs "
                                   "both (docs/guides/sampler.md: which servers supply them)")
        if echoed is not None and list(echoed) != prompt:
            return f"request {request}: the server's prompt_token_ids differ from the tokenizer's ({len(echoed)} vs {len(prompt)} ids)"
        if choice.finish_reason not in FINISH_REASONS:
            return f"request {request}: finish_reason {choice.finish_reason!r}, not one of {sorted(FINISH_REASONS)}"
        if not token_ids or len(token_logprobs) != len(token_ids):
            return f"request {request}: {len(token_ids)} token ids and {len(token_logprobs)} log-probs (need as many, at least one)"
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            return f"request {request}: a token id outside the tokenizer's {self.vocab_size} ids"
        if any(lp is None or not math.isfinite(lp) or lp > 0 for lp in token_logprobs):
            return f"request {request}: a log-prob that is missing, not finite or above 0"
        v = self.settings.policy_version
        return Completion(
            tokens=np.asarray(prompt + list(token_ids), np.uint32), prompt_tokens=len(prompt),
            logprobs=np.concatenate([np.zeros(len(prompt), np.float32), np.asarray(token_logprobs, np.float32)]),
            experts=None, finish_reason=choice.finish_reason, first_version=v, last_version=v,
        )


def _detail(exc: openai.APIError) -> str:
    """The server's own message, one line, short: errors name the cause, not a page of HTML."""
    body = exc.body
    if isinstance(body, dict):
        body = body.get("detail") or body.get("message") or body.get("error") or body
    return " ".join(str(body if body is not None else exc.message).split())[:200]
