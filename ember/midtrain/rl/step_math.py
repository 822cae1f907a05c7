"""The RL step's math as pure torch functions: packing helpers, mismatch metrics, corrections, losses.

Everything works on one packed batch: per-token tensors of length T and `cu_seqlens` [n + 1] marking
the n sequences. Log-probs are per token: `logp[t]` is log p(token t | tokens before it in its
sequence), the convention of the sampler's `sampler_logprobs`, so the first token of a sequence has
none and is never trained.

Mismatch: rho_t = pi(t) / mu(t) = exp(logp_trainer - logp_sampler), computed from the trainer's
log-probs before the update (pi_old), never differentiated.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mis", "seq_geo")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sequence each token belongs to."""
    cu = cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])


def sequence_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] bool, True on the first token of every sequence (it has no log-prob)."""
    cu = cu_seqlens.long()
    starts = torch.zeros(int(cu[-1]), dtype=torch.bool, device=cu.device)
    starts[cu[:-1]] = True
    return starts


def next_token_labels(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """labels[t] = tokens[t + 1] inside a sequence; a sequence's last position gets its own token
    (a placeholder: its prediction would be of the next sequence and is never used)."""
    labels = tokens.clone()
    labels[:-1] = tokens[1:]
    last = cu_seqlens.long()[1:] - 1
    labels[last] = tokens[last]
    return labels


def token_logprobs(next_logp: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Shifts the model's log p(labels[t] | ..t) onto the predicted token: out[t] = next_logp[t - 1],
    0 on sequence starts (which have no prediction)."""
    out = torch.zeros_like(next_logp)
    out[1:] = next_logp[:-1]
    return out.masked_fill(sequence_starts(cu_seqlens), 0.0)


def trainable_mask(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The batch's loss mask (policy tokens) minus sequence starts, as float."""
    return loss_mask.float().masked_fill(sequence_starts(cu_seqlens), 0.0)


def block_diagonal_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked: future tokens and tokens of other sequences (the dense
    equivalent of THD packed attention, for the local layer spec on CPU)."""
    seg = segment_ids(cu_seqlens)
    total = len(seg)
    future = torch.triu(torch.ones(total, total, dtype=torch.bool, device=seg.device), diagonal=1)
    return (future | (seg[:, None] != seg[None, :]))[None, None]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def mismatch_metrics(
    trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, alpha: float, beta: float, cap: float
) -> dict[str, float]:
    """How far the trainer's log-probs are from the sampler's on the policy tokens.

    Both estimators of KL(mu || pi) from tokens sampled by mu: `kl_k1` is mean(-log rho), unbiased but noisy
    and negative on some batches; `kl_mu_pi` is k3, mean(rho - 1 - log rho), unbiased and never negative.
    The importance weights' distribution, which decides what TIS and MIS do to the step: `rho_mean` (1 in
    expectation when mu samples), `frac_above_cap` (tokens TIS truncates at `cap`), `frac_outside` (tokens
    MIS masks: rho outside [alpha, beta]) and the extremes `rho_min` / `rho_max`.
    """
    mask = mask.float()
    log_rho = (trainer_logp - sampler_logp).detach().double()
    rho = log_rho.exp()
    outside = ((rho < alpha) | (rho > beta)).double()
    policy = mask.bool()
    return {
        "mean_abs_delta_logp": float(_masked_mean(log_rho.abs(), mask)),
        "kl_k1": float(_masked_mean(-log_rho, mask)),
        "kl_mu_pi": float(_masked_mean(rho - 1 - log_rho, mask)),
        "rho_mean": float(_masked_mean(rho, mask)),
        "frac_above_cap": float(_masked_mean((rho > cap).double(), mask)),
        "frac_outside": float(_masked_mean(outside, mask)),
        "max_abs_delta_logp": float((log_rho.abs() * mask).max()) if mask.any() else 0.0,
        "rho_max": float(rho[policy].max()) if policy.any() else 1.0,
        "rho_min": float(rho[policy].min()) if policy.any() else 1.0,
    }


def tis_weights(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(rho, C) per token."""
    return log_rho.exp().clamp(max=cap)


def mis_mask(log_rho: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Masked importance sampling (IcePop): keep tokens with alpha <= rho <= beta."""
    rho = log_rho.exp()
    return ((rho >= alpha) & (rho <= beta)).float()


def seq_geo_mask(log_rho: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Sequence-level geometric masking: rho_seq = exp(mean of log rho over the sequence's policy
    tokens); every token of a sequence with rho_seq outside [alpha, beta] is masked."""
    seg = segment_ids(cu_seqlens)
    n = len(cu_seqlens) - 1
    mask = mask.to(log_rho.dtype)
    sums = torch.zeros(n, dtype=log_rho.dtype, device=log_rho.device).index_add_(0, seg, log_rho * mask)
    counts = torch.zeros(n, dtype=log_rho.dtype, device=log_rho.device).index_add_(0, seg, mask)
    rho_seq = (sums / counts.clamp(min=1)).exp()
    keep = (rho_seq >= alpha) & (rho_seq <= beta)
    return keep[seg].float()


def correction_weights(
    kind: str, log_rho: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, *, cap: float, alpha: float, beta: float
) -> torch.Tensor:
    """Per-token factor multiplying the policy-gradient loss (1 = unchanged, 0 = masked)."""
    log_rho = log_rho.detach()
    if kind == "none":
        return torch.ones_like(log_rho)
    if kind == "tis":
        return tis_weights(log_rho, cap)
    if kind == "mis":
        return mis_mask(log_rho, alpha, beta)
    if kind == "seq_geo":
        return seq_geo_mask(log_rho, mask, cu_seqlens, alpha, beta)
    raise ValueError(f"correction must be one of {CORRECTIONS}, got {kind!r}")


def ppo_clipped_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with
    r = exp(logp - old_logp); also returns where the clipped branch was taken (no gradient there)."""
    ratio = (logp - old_logp.detach()).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def aggregate_terms(
    per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, *, max_tokens: int | None = None,
    episodes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch loss as (numerator, denominator), both additive over whole sequences: a batch split by
    sequence across ranks has the sums of its parts' terms, so the global loss is sum(num) / sum(den).

    token_mean: sum over masked tokens / their count.
    seq_mean: the sum of each sequence's token mean (sequences with at least one masked token) / their
      count, so long and short rollouts weigh the same (GRPO's 1/|o_i|).
    constant: Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): sum over masked tokens /
      (max_tokens x sequences), a normaliser independent of every rollout's length, so no length bias.

    Episodes: `episodes` [S] numbers each sequence's episode (an episode's segments are consecutive
    sequences sharing a number; None: each sequence is its own). token_mean counts an episode's tokens once
    each whatever its segments (a summary is trained where the model wrote it, context after); seq_mean takes
    the token mean over the whole episode, so a 3-segment episode weighs as one sample, as it would written as
    one long sequence; constant stays global, max_tokens per context (the generation budget each segment had).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum(), mask.sum()
    if mode == "seq_mean":
        seg = segment_ids(cu_seqlens)
        n = len(cu_seqlens) - 1
        if episodes is not None:
            seg = episodes.long().to(seg.device)[seg]
            n = int(episodes.max()) + 1 if len(episodes) else 0
        sums = torch.zeros(n, dtype=per_token.dtype, device=per_token.device).index_add(0, seg, masked)
        counts = torch.zeros(n, dtype=per_token.dtype, device=per_token.device).index_add(0, seg, mask)
        present = counts > 0
        return (sums[present] / counts[present]).sum(), present.sum().to(per_token.dtype)
    if mode == "constant":
        if max_tokens is None or max_tokens <= 0:
            raise ValueError(f"the constant normaliser needs max_tokens > 0 (the generation budget), got {max_tokens}")
        sequences = len(cu_seqlens) - 1
        return masked.sum(), torch.tensor(float(max_tokens * sequences), dtype=per_token.dtype, device=per_token.device)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, *, max_tokens: int | None = None,
    episodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch loss under `mode` (see `aggregate_terms`); an empty batch (no masked token) is 0."""
    numerator, denominator = aggregate_terms(per_token, mask, cu_seqlens, mode, max_tokens=max_tokens, episodes=episodes)
    return numerator / denominator.clamp(min=1)


def check_generation_budget(mask: torch.Tensor, cu_seqlens: torch.Tensor, max_tokens: int) -> int | None:
    """The index of the first sequence with more policy tokens than `max_tokens`, or None: the
    constant normaliser assumes no rollout exceeds the budget it divides by."""
    seg = segment_ids(cu_seqlens)
    counts = torch.zeros(len(cu_seqlens) - 1, dtype=torch.float64, device=mask.device).index_add(0, seg, mask.double())
    over = torch.nonzero(counts > max_tokens)
    return int(over[0]) if len(over) else None


def expert_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, top_k] expert ids -> [T, num_experts] bool routing map."""
    out = torch.zeros(indices.shape[0], num_experts, dtype=torch.bool, device=indices.device)
    return out.scatter_(1, indices.long(), True)


def routing_disagreement(routing_map: torch.Tensor, sampler_indices: torch.Tensor) -> float:
    """Fraction of tokens whose set of routed experts differs from the sampler's (one layer)."""
    expected = expert_map(sampler_indices, routing_map.shape[1])
    return float((routing_map.bool() != expected).any(dim=1).double().mean())


def repeats_an_expert(indices: torch.Tensor) -> bool:
    """True when some token lists one expert twice in its top-k ([..., top_k] ids): a real router
    never does, and replaying it would route that token to fewer than top_k experts."""
    ordered = indices.sort(dim=-1).values
    return bool((ordered[..., 1:] == ordered[..., :-1]).any())
