"""Batched sampling over transformers' forward pass, recording what the trainer needs per token.

Why not `model.generate`: it returns the processed scores but not the routers' choices per generated token,
and the routed experts of the last sampled token (which the trainer's forward also routes) need one more
forward pass than generation makes. This loop is generate's own recipe (left-padded prompts, the KV cache,
transformers' temperature and top-p warpers), with the router logits of every forward kept.

Per completion: the token ids (prompt + completion), the log-prob of each sampled token under the distribution
it was drawn from (logits / temperature, ids the tokenizer does not have removed, then top-p), 0 on prompt
tokens, and the top-k experts of every token in every MoE layer from the router logits.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from ember.inference.backend import Completion, Sampling
from ember.inference.policy import LoadedPolicy
from ember.schemas.rollouts import routed_experts_dtype


def sampling_logprobs(logits: torch.Tensor, sampling: Sampling, vocab_size: int) -> torch.Tensor:
    """log p of every id under the sampling distribution, from raw logits [..., V]: ids at or above `vocab_size`
    (the tokenizer's; the embedding's padding rows lie above it) removed, divided by the temperature, then top-p.
    What a sampled token's recorded log-prob is, and what a check recomputes."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = logits.float().reshape(-1, logits.shape[-1])
    scores[:, vocab_size:] = float("-inf")
    scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_p < 1:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores.log_softmax(-1).reshape(logits.shape)


def router_top_k(router_logits: tuple[torch.Tensor, ...], shape: tuple[int, int], top_k: int) -> torch.Tensor:
    """[B, T, layers, top_k] expert ids from transformers' per-layer router logits ([B*T, experts] each)."""
    return torch.stack([layer.topk(top_k, dim=-1).indices.view(*shape, top_k) for layer in router_logits], dim=2)


def _step(model, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache) -> tuple[torch.Tensor, tuple]:
    """The next-token logits [B, V] and every layer's router logits for `ids`, extending `cache`. Through the
    decoder (`model.model`) and the head, not `MixtralForCausalLM.forward`: asked for router logits, that one also
    computes the auxiliary load-balancing loss, which fails on a cached step with an attention mask."""
    out = model.model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True,
                      output_router_logits=True)
    return model.lm_head(out.last_hidden_state[:, -1]), out.router_logits


def _prefill(model, ids: torch.Tensor, attention: torch.Tensor) -> tuple[DynamicCache, torch.Tensor, tuple]:
    cache = DynamicCache(config=model.config)
    return cache, *_step(model, ids, attention, (attention.cumsum(-1) - 1).clamp(min=0), cache)


@torch.no_grad()
def generate(policy: LoadedPolicy, prompts: list[list[int]], sampling: Sampling, generator: torch.Generator, *,
             refresh: Callable[[], LoadedPolicy | None] | None = None, refresh_every: int = 0) -> list[Completion]:
    """One completion per prompt (repeat a prompt G times for a group), all generated together.

    With `refresh`, every `refresh_every` decode steps it may return a newer policy: the rest is sampled with
    it, after its forward pass over the sequences so far rebuilt the KV cache. Tokens keep the log-probs and
    experts of the weights that sampled them (the rebuilt cache's routing of earlier tokens is not recorded)."""
    config = policy.model.config
    vocab_size = policy.config.ember.tokenizer_vocab_size
    top_k, experts_dtype = config.num_experts_per_tok, routed_experts_dtype(config.num_local_experts)
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), sampling.pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    cache, logits, router_logits = _prefill(policy.model, ids, attention)
    routed = [router_top_k(router_logits, (batch, width), top_k)]
    first_version, versions = policy.version, []
    alive = torch.ones(batch, dtype=torch.bool)
    stopped = torch.zeros(batch, dtype=torch.bool)
    logprobs, lengths = [], torch.zeros(batch, dtype=torch.long)
    for step in range(sampling.max_new_tokens):
        if refresh is not None and step and step % refresh_every == 0 and (newer := refresh()) is not None:
            policy = newer
            cache, logits, _ = _prefill(policy.model, ids, attention)
        logp = sampling_logprobs(logits, sampling, vocab_size)
        token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
        token = torch.where(alive, token, sampling.pad_id)
        ids = torch.cat([ids, token[:, None]], dim=1)
        logprobs.append(logp.gather(1, token[:, None])[:, 0])
        versions.append(policy.version)
        lengths += alive
        attention = torch.cat([attention, alive[:, None].long()], dim=1)
        if sampling.eos_id is not None:
            stopped |= alive & (token == sampling.eos_id)
            alive &= token != sampling.eos_id
        logits, router_logits = _step(policy.model, token[:, None], attention, attention.sum(-1, keepdim=True) - 1, cache)
        routed.append(router_top_k(router_logits, (batch, 1), top_k))  # the token just sampled, as the trainer routes it
        if not alive.any():
            break
    new_tokens = ids[:, width:].numpy()
    new_logprobs = torch.stack(logprobs, 1).numpy().astype(np.float32)
    experts = torch.cat(routed, 1).numpy()
    completions = []
    for row, prompt in enumerate(prompts):
        n = int(lengths[row])
        completions.append(Completion(
            tokens=np.concatenate([np.asarray(prompt, np.uint32), new_tokens[row, :n].astype(np.uint32)]),
            prompt_tokens=len(prompt),
            logprobs=np.concatenate([np.zeros(len(prompt), np.float32), new_logprobs[row, :n]]),
            experts=experts[row, width - len(prompt) : width + n].astype(experts_dtype),
            finish_reason="stop" if stopped[row] else "length",
            first_version=first_version,
            last_version=versions[n - 1],
        ))
    return completions
