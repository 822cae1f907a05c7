"""The sampler's side of a policy announcement: read the export at the announced URI through the one checked
reader (`export_format.read_export`) and score token sequences with a plain-torch Mixtral forward pass.

Why it exists: it is the smallest inference engine that reads only what `midtrain export-hf` writes
(config.json + model.safetensors under Mixtral's names, no megatron import), so a test can show that an
announced version is what the trainer trained: same weights, same log-probs. It follows the Mixtral
definition (RMSNorm, rotate-half RoPE, grouped-query attention, softmax over the top-k router logits,
SwiGLU experts); one sequence at a time, no KV cache: tiny models only.

`python -m ember.midtrain.hf_policy URI SHA256 IN.json OUT.json` scores the token lists in IN.json
({"sequences": [[...], ...]}) and writes {"logprobs": [[...], ...]} (0 for each first token).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
import torch.nn.functional as F

from ember.midtrain.export_format import PolicyConfig, PolicyFetchError, read_export


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise PolicyFetchError(f"{uri}: only file:// URIs on a shared filesystem are fetched here")
    return Path(unquote(parsed.path))


@dataclass
class HFPolicy:
    config: PolicyConfig
    weights: dict[str, torch.Tensor]

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weights[name]

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, T, head_dim], positions 0..T-1, the rotate-half convention."""
        dim, length = x.shape[-1], x.shape[-2]
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        half = dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _attention(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        c, w = self.config, self.weights
        heads, groups, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        length = x.shape[0]
        q = (x @ w[prefix + "q_proj.weight"].T).view(length, heads, head_dim).transpose(0, 1)
        k = (x @ w[prefix + "k_proj.weight"].T).view(length, groups, head_dim).transpose(0, 1)
        v = (x @ w[prefix + "v_proj.weight"].T).view(length, groups, head_dim).transpose(0, 1)
        q, k = self._rope(q), self._rope(k)
        k, v = k.repeat_interleave(heads // groups, 0), v.repeat_interleave(heads // groups, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(head_dim)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        attended = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return attended.transpose(0, 1).reshape(length, heads * head_dim) @ w[prefix + "o_proj.weight"].T

    def _moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w, top_k = self.weights, self.config.num_experts_per_tok
        logits = x @ w[prefix + "gate.weight"].T
        top, chosen = logits.topk(top_k, dim=-1)
        probs = top.softmax(-1)
        out = torch.zeros_like(x)
        for expert in range(self.config.num_local_experts):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            if len(rows) == 0:
                continue
            e = f"{prefix}experts.{expert}."
            h = F.silu(x[rows] @ w[e + "w1.weight"].T) * (x[rows] @ w[e + "w3.weight"].T)
            out.index_add_(0, rows, (h @ w[e + "w2.weight"].T) * probs[rows, slot, None])
        return out

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weights
        x = w["model.embed_tokens.weight"][tokens]
        for layer in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            x = x + self._attention(self._rms(x, prefix + "input_layernorm.weight"), prefix + "self_attn.")
            x = x + self._moe(self._rms(x, prefix + "post_attention_layernorm.weight"), prefix + "block_sparse_moe.")
        return self._rms(x, "model.norm.weight") @ w["lm_head.weight"].T

    def token_logprobs(self, tokens: list[int]) -> list[float]:
        """log p(token t | tokens < t) for every token, 0 for the first (the trainer's layout)."""
        ids = torch.tensor(tokens, dtype=torch.int64)
        logp = self.logits(ids).float().log_softmax(-1)
        return [0.0] + logp[:-1].gather(1, ids[1:, None])[:, 0].tolist()


def load_policy(uri: str, sha256: str) -> HFPolicy:
    """The export at `uri` whose export.json hashes to the announced `sha256`: every file checked against it,
    the config validated, the weights parsed from the very bytes that were hashed."""
    return HFPolicy(*read_export(local_path(uri), sha256).load())


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m ember.midtrain.hf_policy URI SHA256 IN.json OUT.json", file=sys.stderr)
        return 2
    uri, sha256, source, out = argv
    try:
        policy = load_policy(uri, sha256)
    except PolicyFetchError as exc:
        print(f"[hf_policy] {exc}", file=sys.stderr)
        return 1
    sequences = json.loads(Path(source).read_text())["sequences"]
    Path(out).write_text(json.dumps({"logprobs": [policy.token_logprobs(s) for s in sequences]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
