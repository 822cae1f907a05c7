"""Megatron-side work for test_rl_packing, in a subprocess (megatron-core keeps global parallel state).

`python -m tests.midtrain.packing_support CONFIG OUT.json` builds the real RL trainer from CONFIG and
writes: the attention kind it detected; the log-probs of a packed row of three rollouts, of the same
row with the middle rollout's tokens replaced, and of the perturbed row under a plain causal mask
(the mask a backend that ignores the block-diagonal one would apply); the error for a rollout over
rl.max_generation_tokens; the error for a batch stamped with another advantage estimator; the error
for a model whose local attention uses the fused causal softmax.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from ember.schemas import TrainBatch

if TYPE_CHECKING:
    from ember.midtrain.rl.batch import RLBatch

# torch is imported inside the functions: megatron's checkpoint-writer helper, started by multiprocessing
# spawn, imports this `__main__` module again.

LENGTHS = (7, 9, 6)


def packed_row(tokens: np.ndarray, lengths: tuple[int, ...] = LENGTHS, estimator: str | None = None,
               estimators: tuple[str, ...] = ()) -> RLBatch:
    from ember.midtrain.rl.batch import rl_batch

    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lengths)
    n = int(cu[-1])
    return rl_batch(
        TrainBatch(
            batch_id="packed", step=0, tokens=tokens.astype(np.uint32), loss_mask=np.ones(n, np.uint8),
            advantages=np.zeros(n, np.float32), sampler_logprobs=np.zeros(n, np.float32), cu_seqlens=cu,
            policy_versions=np.zeros(len(lengths), np.int64), rollout_ids=[f"r{i}" for i in range(len(lengths))],
            advantage_estimator=estimator, advantage_estimators=list(estimators),
        ).validate()
    )


def main(config_path: str, out: str) -> None:
    import torch

    from ember.midtrain.rl import step_math
    from ember.midtrain.model import build_model, packed_attention, transformer_config
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.trainer import RLTrainer, _model_forward

    config = load_rl_config(config_path)
    trainer = RLTrainer(config)
    vocab = config.model.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, sum(LENGTHS))
    perturbed = tokens.copy()
    middle = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    perturbed[middle] = (tokens[middle] + rng.integers(1, vocab, LENGTHS[1])) % vocab  # every token differs
    result: dict = {"attention": trainer.attention, "lengths": LENGTHS}
    result["logp"] = trainer.logprobs(packed_row(tokens)).tolist()
    result["logp_perturbed"] = trainer.logprobs(packed_row(perturbed)).tolist()
    inputs = trainer._inputs(packed_row(perturbed))
    causal_only = torch.triu(torch.ones(len(perturbed), len(perturbed), dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        leaky = _model_forward(trainer.model, inputs.__class__(**{**vars(inputs), "attention_mask": causal_only}))
    result["logp_perturbed_causal_only"] = step_math.token_logprobs(-leaky[0].float(), inputs.cu_seqlens).tolist()
    over_budget = (config.rl.max_generation_tokens or 0) + 2
    try:
        trainer.logprobs(packed_row(rng.integers(0, vocab, over_budget + 3), (3, over_budget)))
        result["budget_error"] = None
    except ValueError as exc:
        result["budget_error"] = str(exc)
    try:
        trainer.logprobs(packed_row(tokens, estimator="grpo"))
        result["estimator_error"] = None
    except ValueError as exc:
        result["estimator_error"] = str(exc)
    result["logp_same_estimator"] = trainer.logprobs(packed_row(tokens, estimator=config.rl.estimator)).tolist()
    mixed = (config.rl.estimator, "product_ema", config.rl.estimator)  # group samples and a product single
    result["logp_mixed"] = trainer.logprobs(packed_row(tokens, estimators=mixed)).tolist()
    try:
        trainer.logprobs(packed_row(tokens, estimators=("product_ema", "grpo", "product_loo")))
        result["mixed_error"] = None
    except ValueError as exc:
        result["mixed_error"] = str(exc)
    tconfig = transformer_config(config, bf16=True)
    tconfig.masked_softmax_fusion = True
    try:
        result["fused_softmax_attention"] = packed_attention(build_model(config, tconfig))
    except ValueError as exc:
        result["fused_softmax_attention"] = str(exc)
    trainer.close()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
