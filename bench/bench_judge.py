"""LLM judge latency and throughput against a real OpenAI-compatible server, with the raw openai client as the anchor.

The server is `transformers serve` hosting the tiny random Llama the judge's tests build
(tests/rollouts/grading/judge_server.py), on 127.0.0.1, CPU only. Each request asks the rubric for one
completion; a logit bias shapes the one-token answer into a score, so every judge grade is SCORED and the
requests are the same for both paths. `judge` is `LLMJudge.grade_batch` over --items completions at
max_concurrency 1 and 4 (rate limits set far above what the server can serve, no cache); `raw` is
`openai.AsyncOpenAI` sending the same requests under an asyncio.Semaphore of the same size. Latency is one
request's, from sent to answered (httpx event hooks, the same in both paths); throughput is completions per
second of wall clock for the whole batch. Medians over --repeats, the paths taking turns.

    .venv/bin/python bench/bench_judge.py [--items 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ember and its tests' server

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.grading.base import Task, Verdict  # noqa: E402
from ember.rollouts.grading.judge import JudgeSettings, LLMJudge  # noqa: E402
from tests.rollouts.grading.judge_server import JudgeServer, build_tiny_model  # noqa: E402

RUBRIC = "Rate the answer from 0 to 10. Reply with the number only.\nQuestion: {prompt}\nAnswer: {completion}\nScore:"
KEY_ENV = "EMBER_BENCH_JUDGE_KEY"


class Timings:
    """Per-request latency from httpx's hooks: a request's send time, matched to its answer by object identity."""

    def __init__(self) -> None:
        self.sent: dict[int, float] = {}
        self.latencies: list[float] = []

    def client(self) -> httpx.AsyncClient:
        async def on_request(request: httpx.Request) -> None:
            self.sent[id(request)] = time.perf_counter()

        async def on_response(response: httpx.Response) -> None:
            await response.aread()
            self.latencies.append(time.perf_counter() - self.sent.pop(id(response.request)))

        return httpx.AsyncClient(event_hooks={"request": [on_request], "response": [on_response]})


def run_judge(settings: JudgeSettings, items: list[tuple[Task, str]]) -> tuple[float, list[float]]:
    timings = Timings()
    with LLMJudge(settings, http_client=timings.client()) as judge:
        start = time.perf_counter()
        grades = judge.grade_batch(items)
        wall = time.perf_counter() - start
    bad = [g for g in grades if g.verdict is not Verdict.SCORED]
    if bad:
        raise SystemExit(f"judge: {len(bad)} of {len(grades)} not scored, e.g. {bad[0]}")
    return wall, timings.latencies


def run_raw(settings: JudgeSettings, items: list[tuple[Task, str]]) -> tuple[float, list[float]]:
    timings = Timings()

    async def batch() -> float:
        client = openai.AsyncOpenAI(base_url=settings.base_url, api_key=os.environ[KEY_ENV], max_retries=0, http_client=timings.client())
        slots = asyncio.Semaphore(settings.max_concurrency)

        async def ask(task: Task, completion: str) -> float:
            async with slots:
                response = await client.chat.completions.create(
                    model=settings.model,
                    messages=[{"role": "user", "content": settings.rubric.format(prompt=task.prompt, completion=completion)}],
                    max_tokens=settings.max_tokens,
                    temperature=settings.temperature,
                    logit_bias={str(k): v for k, v in settings.logit_bias.items()},
                )
            return float(response.choices[0].message.content)

        start = time.perf_counter()
        await asyncio.gather(*(ask(task, completion) for task, completion in items))
        wall = time.perf_counter() - start
        await client.close()
        return wall

    return asyncio.run(batch()), timings.latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=None, help="default: quick 16, full 64")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.items = args.items or profile_default(args.profile, 16, 64)
    figures = []
    os.environ[KEY_ENV] = "sk-bench-local"
    with tempfile.TemporaryDirectory() as tmp:
        server = JudgeServer(build_tiny_model(Path(tmp) / "model"), Path(tmp) / "serve.log")
        server.start()
        try:
            items = [(Task(f"p{i}", f"def f{i}(x):"), f"    return x + {i}") for i in range(args.items)]
            print(f"| {args.items} completions, tiny Llama on `transformers serve` (CPU) | p50 ms | p99 ms | completions/s | vs raw |")
            print("|---|---|---|---|---|")
            for concurrency in (1, 4):
                settings = JudgeSettings(
                    base_url=server.url, model=str(server.model_dir), api_key_env=KEY_ENV, rubric=RUBRIC, max_tokens=1,
                    logit_bias={server.token_id("7"): 100.0}, max_concurrency=concurrency,
                    requests_per_minute=1e9, tokens_per_minute=10**12, retries=0,
                )  # fmt: skip
                runs: dict[str, list[tuple[float, list[float]]]] = {"raw": [], "judge": []}
                run_raw(settings, items[:4])  # warm the server's first-request path
                for _ in range(args.repeats):
                    runs["raw"].append(run_raw(settings, items))
                    runs["judge"].append(run_judge(settings, items))
                rates = {path: statistics.median(args.items / wall for wall, _ in r) for path, r in runs.items()}
                for path in ("raw", "judge"):
                    p50 = statistics.median(percentile(lat, 50) for _, lat in runs[path]) * 1e3
                    p99 = statistics.median(percentile(lat, 99) for _, lat in runs[path]) * 1e3
                    name = "raw `AsyncOpenAI`" if path == "raw" else "**ember `LLMJudge`**"
                    print(f"| {name}, concurrency {concurrency} | {p50:.1f} | {p99:.1f} | {rates[path]:.1f} | {rates[path] / rates['raw']:.2f}x |")
                figures.append(Figure(f"completions/s, concurrency {concurrency}", "completions/s", rates["judge"],
                                      rates["raw"], "raw AsyncOpenAI", repeats=args.repeats))
        finally:
            server.kill()
    write_results(args.results, "bench_judge", args.profile, figures, items=args.items)


if __name__ == "__main__":
    main()
