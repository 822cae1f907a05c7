"""The sampler's throughput against plain `model.generate` on the same transformers model and batch.

Both draw `--new-tokens` tokens for every sequence of one batch (G completions of each prompt, left-padded
prompts, KV cache, temperature 1 and top-p 0.95, no end-of-sequence so every sequence runs to the end).
`model.generate` returns the tokens only; ember's loop also records each sampled token's log-prob, the router
top-k of every token in every layer (one extra forward for the last token) and builds and encodes the Rollout
messages (everything `ember rollouts sample` does but the broker round trip). The two alternate within each
repeat; reported: median generated tokens/s of each and ember's overhead. The policy is the tiny RL example's
shape (rl_tiny_cpu.yaml) on CPU, where per-step Python work weighs more than on a real model. Timing never
decides pass/fail.

    .venv/bin/python bench/bench_sampler.py [--prompts 8] [--group-size 4] [--new-tokens 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from bench_mismatch import trainer_and_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: quick 24, full 48")
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 3, full 5")
    add_flags(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or profile_default(args.profile, 3, 5)
    args.new_tokens = args.new_tokens or profile_default(args.profile, 24, 48)
    from ember.inference.config import SamplerConfig
    from ember.inference.generate import Sampling, generate
    from ember.inference.tasks import Task
    from ember.inference.worker import to_rollouts
    from ember.schemas import encode

    trainer, policy = trainer_and_policy(Path(tempfile.mkdtemp(prefix="bench-sampler-")))
    trainer.close()
    rng = np.random.default_rng(0)
    vocab = policy.config.ember.tokenizer_vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    batch = [p for p in prompts for _ in range(args.group_size)]
    sampling = Sampling(1.0, 0.95, args.new_tokens, eos_id=None, pad_id=0)
    config = SamplerConfig.model_validate({
        "kafka": {"topic_prefix": "bench"}, "tasks": "unused.jsonl", "tokenizer": {"name": "unused"},
        "generation": {"group_size": args.group_size, "batch_size": len(batch)},
    })
    tasks = [Task(f"p{i}", "") for i in range(args.prompts)]
    ids = torch.tensor(batch)

    def plain() -> int:
        out = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                    top_p=0.95, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * len(batch)

    def ember() -> int:
        done = generate(policy, batch, sampling, torch.Generator().manual_seed(1))
        for rollout in to_rollouts(config, 0, tasks, done):
            encode(rollout)
        return sum(len(c.tokens) - c.prompt_tokens for c in done)

    rates: dict[str, list[float]] = {"model.generate": [], "ember sampler": []}
    plain(), ember()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("model.generate", plain), ("ember sampler", ember)):
            t0 = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - t0))
    base, ours = statistics.median(rates["model.generate"]), statistics.median(rates["ember sampler"])
    print(f"batch {len(batch)} sequences ({args.prompts} prompts x G={args.group_size}), {args.prompt_tokens} prompt + "
          f"{args.new_tokens} new tokens each, {torch.get_num_threads()} threads")
    print(f"model.generate: {base:,.0f} tokens/s; ember sampler (log-probs, experts, Rollouts encoded): {ours:,.0f} tokens/s; "
          f"overhead {(base / ours - 1) * 100:+.1f}%")
    write_results(args.results, "bench_sampler", args.profile, [
        Figure("generated tokens/s", "tokens/s", ours, base, "transformers model.generate", repeats=args.repeats)],
        batch=len(batch), new_tokens=args.new_tokens, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
