"""An LLM judge: a reward from any OpenAI-compatible endpoint, for what unit tests cannot check.

A judge's answer is text from a model, so nothing about it is trusted: a score is a whole answer that is one
number inside the configured range, or the answer is MALFORMED (retried first, never guessed). A server that is
down, slow or overloaded is retried with backoff, then the grade is UNAVAILABLE, so the service can tell "the
judge could not answer" from "the judge said 0". Requests are bounded three ways (in flight, per minute, tokens
per minute) because a judge is usually a shared, metered endpoint. Final grades are cached on disk under the
rollout's hash and the rubric's, so a restarted grader never pays for the same question twice.

No Kafka, Beam or torch here (import-linter holds it): the service owns the transport.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import sqlite3
import string
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import openai
from aiolimiter import AsyncLimiter
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field, model_validator
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from ember.configs import APIKeySource
from ember.rollouts.grading.base import Grade, Task, Verdict

log = logging.getLogger(__name__)

JUDGE_VERSION = "1"
"""Bumped when the way a score is asked for or read changes; the rubric's own hash is appended to it."""

_SCORE = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*")
_DETAIL_CHARS = 120


class JudgeError(RuntimeError):
    """The judge cannot start (its key cannot be read); names the key's source, never its content."""


def _placeholders(template: str, allowed: set[str], what: str) -> str:
    """`template` if it formats with exactly `allowed` fields; else a ValueError that says which are wrong."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"{what} is not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from None
    if fields != allowed:
        missing, unknown = sorted(allowed - fields), sorted(fields - allowed)
        raise ValueError(
            f"{what} must use exactly the placeholders {sorted('{' + f + '}' for f in allowed)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )
    return template


class JudgeSettings(APIKeySource):
    base_url: str = Field(..., pattern=r"^https?://", description="the OpenAI-compatible endpoint, e.g. http://host:8000/v1")
    model: str = Field(..., min_length=1, description="the model name the endpoint serves")
    rubric: str = Field(
        ..., description="the question, with {prompt} and {completion}; the answer must be one number in the score range"
    )
    swap_rubric: str | None = Field(
        None,
        description=(
            "pairwise swap check, with {prompt}, {first} and {second}: the completion and the task's reference answer "
            "are shown in both orders and the answer is how much better {first} is (score_max: first is best)"
        ),
    )
    score_min: int = Field(0, description="lowest score the rubric allows")
    score_max: int = Field(10, description="highest score the rubric allows")
    max_tokens: int = Field(8, ge=1, le=4096, description="answer length cap: a score needs a few tokens")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="token id -> bias, to steer the answer toward score tokens"
    )
    max_concurrency: int = Field(4, ge=1, le=256, description="requests in flight at once")
    requests_per_minute: float = Field(60.0, gt=0, description="requests are spaced 60/rpm seconds apart, no burst")
    tokens_per_minute: int = Field(100_000, ge=1, description="estimated prompt + max_tokens per minute (token bucket)")
    timeout_s: float = Field(30.0, gt=0, description="one request's limit; a slower answer is retried")
    retries: int = Field(3, ge=0, le=20, description="retries of a timeout, a server error or a malformed answer")
    backoff_s: float = Field(0.5, ge=0, description="first retry's wait; doubles, with jitter, up to backoff_max_s")
    backoff_max_s: float = Field(8.0, ge=0)
    cache_dir: Path | None = Field(None, description="final grades are kept here; None: no cache")

    @model_validator(mode="after")
    def _consistent(self) -> "JudgeSettings":
        if self.api_key_file is None and self.api_key_env is None:
            raise ValueError("give exactly one key source: api_key_file or api_key_env")
        _placeholders(self.rubric, {"prompt", "completion"}, "rubric")
        if self.swap_rubric is not None:
            _placeholders(self.swap_rubric, {"prompt", "first", "second"}, "swap_rubric")
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min ({self.score_min}) must be below score_max ({self.score_max})")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be at least backoff_s ({self.backoff_s})")
        return self

    def api_key(self) -> str:
        """The only place the key is read; it goes straight into the client and is never logged."""
        key = self.read_api_key(JudgeError)
        assert key is not None, "the validator requires a key source"
        return key

    def rubric_hash(self) -> str:
        """Everything that changes what a score means: a cached grade is reused only under the same hash."""
        meaning = self.model_dump(mode="json", include={"model", "rubric", "swap_rubric", "score_min", "score_max", "max_tokens", "temperature", "logit_bias"})
        return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()


def parse_score(answer: str, low: int, high: int) -> float:
    """The score in `answer`, which must be one number in [low, high] and nothing else; ValueError otherwise."""
    match = _SCORE.fullmatch(answer)
    if match is None:
        raise ValueError(f"not a number: {answer[:_DETAIL_CHARS]!r}")
    score = float(match.group(1))
    if not low <= score <= high:
        raise ValueError(f"{score:g} is outside [{low}, {high}]")
    return score


def completion_key(task: Task, completion: str) -> str:
    """sha256 of what was graded, for when the caller has no rollout hash of its own."""
    digest = hashlib.sha256()
    for part in (task.prompt, task.reference, completion):
        digest.update(len(part.encode()).to_bytes(8, "big") + part.encode())
    return digest.hexdigest()


class _Malformed(Exception):
    """The judge answered, but not with a score; retried like a server error, then MALFORMED."""


class _Refused(Exception):
    """A 4xx other than 429: asking again would get the same answer."""


_TRANSIENT = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError, _Malformed)


class GradeCache:
    """Final grades on disk (sqlite: atomic writes, several grader processes may share it), keyed by
    the completion's hash and the rubric's."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(directory / "judge-grades.sqlite", timeout=30, check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS grades (key TEXT PRIMARY KEY, grade TEXT NOT NULL)")
        self._db.commit()

    def get(self, key: str) -> Grade | None:
        row = self._db.execute("SELECT grade FROM grades WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        data = json.loads(row[0])
        return Grade(Verdict(data["verdict"]), data["score"], data["components"], data["detail"])

    def put(self, key: str, grade: Grade) -> None:
        value = json.dumps({"verdict": grade.verdict.value, "score": grade.score, "components": grade.components, "detail": grade.detail})
        self._db.execute("INSERT OR REPLACE INTO grades (key, grade) VALUES (?, ?)", (key, value))
        self._db.commit()

    def close(self) -> None:
        self._db.close()


class LLMJudge:
    """The Grader protocol over an OpenAI-compatible chat endpoint. `grade_batch` runs a batch's requests
    concurrently on the judge's own event loop, so limiters and the HTTP client live across batches; one batch
    at a time (the service's loop calls it), close() when done."""

    name = "llm_judge"

    def __init__(self, settings: JudgeSettings, http_client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.rubric_hash = settings.rubric_hash()
        self.version = f"{JUDGE_VERSION}+{self.rubric_hash[:12]}"
        self._key = settings.api_key()
        self._client = openai.AsyncOpenAI(
            base_url=settings.base_url, api_key=self._key, timeout=settings.timeout_s, max_retries=0, http_client=http_client
        )
        self._loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._requests = AsyncLimiter(1, 60.0 / settings.requests_per_minute)
        self._tokens = AsyncLimiter(settings.tokens_per_minute, 60.0)
        self._cache = GradeCache(settings.cache_dir) if settings.cache_dir is not None else None
        self._latency: Histogram | None = None
        self._errors: Counter | None = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """The judge's request latency and its errors by kind, on the grading service's /metrics (called once)."""
        self._latency = Histogram(
            "ember_judge_request_seconds", "Seconds from sending a judge request to its answer (failed ones too)",
            registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self._errors = Counter(
            "ember_judge_errors_total", "Judge requests that gave no score, by kind (each retry counts)", ["kind"],
            registry=registry,
        )

    def _count_error(self, kind: str) -> None:
        if self._errors is not None:
            self._errors.labels(kind).inc()

    def grade_batch(self, items: Sequence[tuple[Task, str]], keys: Sequence[str] | None = None) -> list[Grade]:
        """Grades in the order of `items`; `keys` (the rollouts' sha256) name them in the cache, else their text does."""
        if keys is not None and len(keys) != len(items):
            raise ValueError(f"{len(keys)} keys for {len(items)} items")
        names = keys if keys is not None else [completion_key(task, completion) for task, completion in items]
        return self._loop.run_until_complete(self._grade_all(items, names))

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> "LLMJudge":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def render(self, task: Task, completion: str) -> list[str]:
        """The questions one completion costs: the rubric, or the swap rubric in both orders (completion first)."""
        s = self.settings
        if s.swap_rubric is None or not task.reference:
            return [s.rubric.format(prompt=task.prompt, completion=completion)]
        return [
            s.swap_rubric.format(prompt=task.prompt, first=completion, second=task.reference),
            s.swap_rubric.format(prompt=task.prompt, first=task.reference, second=completion),
        ]

    async def _grade_all(self, items: Sequence[tuple[Task, str]], keys: Sequence[str]) -> list[Grade]:
        return list(await asyncio.gather(*(self._grade(task, completion, key) for (task, completion), key in zip(items, keys))))

    async def _grade(self, task: Task, completion: str, key: str) -> Grade:
        cache_key = f"{key}:{self.rubric_hash}"
        if self._cache is not None and (cached := self._cache.get(cache_key)) is not None:
            return cached
        questions = self.render(task, completion)
        answers = await asyncio.gather(*(self._ask(q) for q in questions), return_exceptions=True)
        grade = self._combine(task, answers)
        if grade.verdict is not Verdict.UNAVAILABLE:
            if self._cache is not None:
                self._cache.put(cache_key, grade)
        else:
            log.warning("judge: prompt %s unavailable: %s", task.prompt_id, grade.detail)
        return grade

    def _combine(self, task: Task, answers: list[float | BaseException]) -> Grade:
        """One grade from the answers; any unanswered question decides the verdict, so nothing is half-guessed."""
        s = self.settings
        for answer in answers:
            if isinstance(answer, _Malformed):
                return Grade(Verdict.MALFORMED, 0.0, detail=self._detail(f"prompt {task.prompt_id}: {answer} after {s.retries} retries"))
        for answer in answers:
            if isinstance(answer, BaseException):
                if not isinstance(answer, (openai.OpenAIError, _Refused)):
                    raise answer
                kind = "refused" if isinstance(answer, _Refused) else type(answer).__name__
                return Grade(Verdict.UNAVAILABLE, 0.0, detail=self._detail(f"prompt {task.prompt_id}: {kind}: {answer}"))
        span = s.score_max - s.score_min
        if len(answers) == 1:
            (raw,) = answers
            return Grade(Verdict.SCORED, (raw - s.score_min) / span, {"judge_score": raw})
        first, second = answers
        mirrored = s.score_min + s.score_max - second  # the completion's score as the swapped order states it
        return Grade(
            Verdict.SCORED,
            ((first + mirrored) / 2 - s.score_min) / span,
            {"judge_score": (first + mirrored) / 2, "judge_score_first": first, "judge_score_second": mirrored, "swap_disagreement": abs(first - mirrored) / span},
        )

    def _detail(self, text: str) -> str:
        """One line for a Grade or a log: the key is blanked even if a server echoed it back."""
        return " ".join(text.replace(self._key, "<api key>").split())[: 2 * _DETAIL_CHARS]

    async def _ask(self, question: str) -> float:
        s = self.settings
        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.retries + 1),
            wait=wait_exponential_jitter(initial=s.backoff_s, max=s.backoff_max_s),
            retry=retry_if_exception_type(_TRANSIENT),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._ask_once(question)
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def _ask_once(self, question: str) -> float:
        s = self.settings
        # Tokens are estimated before the request (an answer's usage arrives too late to throttle it): UTF-8 bytes
        # over 3 overcounts most tokenizers, plus the answer's cap.
        estimate = min(s.tokens_per_minute, math.ceil(len(question.encode()) / 3) + s.max_tokens)
        async with self._slots:
            await self._requests.acquire()
            await self._tokens.acquire(estimate)
            started = time.perf_counter()
            try:
                response = await self._client.chat.completions.create(
                    model=s.model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    **({"logit_bias": {str(k): v for k, v in s.logit_bias.items()}} if s.logit_bias else {}),
                )
            except openai.APIStatusError as exc:
                self._count_error(f"http_{exc.status_code}")
                if isinstance(exc, (openai.RateLimitError, openai.InternalServerError)):
                    raise
                raise _Refused(f"HTTP {exc.status_code}: {exc.message}") from None
            except openai.APIConnectionError as exc:
                self._count_error("timeout" if isinstance(exc, openai.APITimeoutError) else "connection")
                raise
            finally:
                if self._latency is not None:
                    self._latency.observe(time.perf_counter() - started)
        answer = response.choices[0].message.content if response.choices else None
        try:
            return parse_score(answer or "", s.score_min, s.score_max)
        except ValueError as exc:
            self._count_error("malformed")
            raise _Malformed(str(exc)) from None
