"""Train/inference mismatch, measured: the RL trainer's megatron-core log-probs against the transformers
sampler's (`ember rollouts sample`) on the very tokens the sampler drew.

One policy (the tiny RL example's shape, rl_tiny_cpu.yaml, megatron-initialised weights), saved by the RL
trainer, exported by `export_checkpoint` and loaded by the sampler through `read_export` into transformers'
`MixtralForCausalLM`. The sampler draws G completions per random prompt at temperature 1 and top-p 1 (its
sampling distribution is then the model's own, which is what the trainer computes), recording log-probs and
router top-k. The trainer then scores the same sequences twice: replay off (its own routing, recorded by
megatron's RouterReplay RECORD) and replay on (the sampler's experts forced, `RLTrainer.logprobs`).

Printed, over completion tokens: mean and max |delta log p|, the k1 and k3 estimators of KL(sampler || trainer),
the distribution of the TIS weights p_trainer / p_sampler; and per MoE layer, over every token, the share whose
top-k expert set is the same in both, with replay off (counted here) and on (the RL step's own
`routing_disagreement_per_layer`, from one `train_step` on these rollouts, run last since it updates the
weights). Differences beyond float32 noise (|delta| ~1e-6) are a bug in the export's mapping or one side's RoPE
or norm, not a number to report. Timing is not measured here.

    .venv/bin/python bench/bench_mismatch.py [--prompts 64] [--group-size 4] [--prompt-tokens 12] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402


def trainer_and_policy(root: Path):
    """The RL trainer on the example's shape (fresh weights, saved at step 0) and that checkpoint's export in transformers."""
    from ember.inference.policy import load_policy
    from ember.midtrain.config import parse_rl_config
    from ember.midtrain.export_hf import export_checkpoint
    from ember.midtrain.rl.trainer import RLTrainer

    data = yaml.safe_load((REPO / "ember/midtrain/examples/rl_tiny_cpu.yaml").read_text())
    data.update(run_dir=str(root / "run"), init_checkpoint=None)
    data["rl"].update(replay="replay", seed=11)
    config = parse_rl_config(data, root)
    trainer = RLTrainer(config)
    checkpoint = trainer.save()
    exported = export_checkpoint(checkpoint, root / "export", config.model, config.moe, {"policy_version": 0, "step": 0})
    return trainer, load_policy(exported.uri, exported.sha256, 0)


def sample(policy, prompts: int, group_size: int, prompt_tokens: int, new_tokens: int):
    from ember.inference.generate import Sampling, generate

    rng = np.random.default_rng(5)
    vocab = policy.config.ember.tokenizer_vocab_size
    ids = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(prompts)]
    sampling = Sampling(1.0, 1.0, new_tokens, eos_id=None, pad_id=0)
    generator, done = torch.Generator().manual_seed(0), []
    for start in range(0, prompts, 8):
        batch = [p for p in ids[start : start + 8] for _ in range(group_size)]
        done += generate(policy, batch, sampling, generator)
    return done


def rl_batch_of(completions):
    from ember.midtrain.rl.batch import rl_batch
    from ember.rollouts.batching import ScoredRollout, build_train_batch
    from ember.schemas import Rollout, decode_train_batch, encode_train_batch

    rollouts = [
        Rollout(rollout_id=f"r{i}", group_id=f"g{i}", prompt_id="p", policy_version=0, sampler="bench", region="",
                created_at_us=0, tokens=c.tokens, loss_mask=(np.arange(len(c.tokens)) >= c.prompt_tokens).astype(np.uint8),
                sampler_logprobs=c.logprobs, routed_experts=c.experts, prompt_tokens=c.prompt_tokens)
        for i, c in enumerate(completions)
    ]
    batch = build_train_batch([ScoredRollout(r, 1.0) for r in rollouts], step=0, source_offsets=[], created_at_us=0)
    return rl_batch(decode_train_batch(encode_train_batch(batch)))


def agreement(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per layer, the share of tokens whose top-k expert *sets* agree ([T, layers, k] each)."""
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(-1).mean(0)


def report(name: str, trainer_logp: np.ndarray, sampler_logp: np.ndarray) -> float:
    delta = trainer_logp.astype(np.float64) - sampler_logp.astype(np.float64)
    log_ratio = -delta  # log p_sampler - log p_trainer, tokens drawn from the sampler
    weights = np.exp(delta)
    q = np.quantile(weights, [0.01, 0.5, 0.99])
    print(f"{name}: mean |dlogp| {np.abs(delta).mean():.2e}, max {np.abs(delta).max():.2e}; "
          f"KL k1 {log_ratio.mean():+.2e}, k3 {(weights - 1 - delta).mean():.2e}; "
          f"TIS weight p1 {q[0]:.5f} median {q[1]:.5f} p99 {q[2]:.5f} max {weights.max():.5f}, "
          f"{(weights > 2).mean() * 100:.2f}% above 2")
    return float(np.abs(delta).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=None, help="default: quick 16, full 64")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=24)
    add_flags(parser)
    args = parser.parse_args()
    args.prompts = args.prompts or profile_default(args.profile, 16, 64)
    from ember.demo.sampler import score

    root = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    trainer, policy = trainer_and_policy(root)
    completions = sample(policy, args.prompts, args.group_size, args.prompt_tokens, args.new_tokens)
    mask = np.concatenate([np.arange(len(c.tokens)) >= c.prompt_tokens for c in completions])
    sampler_logp = np.concatenate([c.logprobs for c in completions])[mask]
    sampler_experts = np.concatenate([c.experts for c in completions])
    tokens = int(mask.sum())
    print(f"{len(completions)} rollouts ({args.prompts} prompts x G={args.group_size}), {tokens} completion tokens, "
          f"{len(mask)} tokens in all; policy {policy.config.num_hidden_layers} layers, top-{policy.config.num_experts_per_tok} "
          f"of {policy.config.num_local_experts} experts, {policy.config.torch_dtype}")

    scored = score(trainer.model, [c.tokens.astype(np.int64) for c in completions])  # replay off: megatron's own routing
    off_logp = np.concatenate([logp for logp, _ in scored])[mask]
    off_experts = np.concatenate([experts for _, experts in scored])
    off = report("replay off", off_logp, sampler_logp)
    on_logp = trainer.logprobs(rl_batch_of(completions)).numpy()[mask]
    on = report("replay on ", on_logp, sampler_logp)
    print("routing agreement per layer, replay off: "
          + ", ".join(f"layer {i} {share * 100:.2f}%" for i, share in enumerate(agreement(off_experts, sampler_experts))))
    step = trainer.train_step(rl_batch_of(completions))  # the trainer's own metric, replay on (last: it updates the weights)
    print("routing agreement per layer, replay on (the RL step's routing_disagreement_per_layer): "
          + ", ".join(f"layer {i} {(1 - d) * 100:.2f}%" for i, d in enumerate(step["routing_disagreement_per_layer"]))
          + f"; the step's own mismatch metrics: {step['mismatch']}")
    trainer.close()
    write_results(args.results, "bench_mismatch", args.profile, [
        Figure("mean |trainer - sampler log-prob|, replay on", "nats", on, off, "replay off", higher_is_better=False)],
        prompts=args.prompts, group_size=args.group_size, tokens=tokens)


if __name__ == "__main__":
    main()
