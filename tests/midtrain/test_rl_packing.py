"""Packed rollouts stay apart in the RL trainer's attention, on the backend the model was built with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.midtrain.rl import step_math
from ember.midtrain.rl.batch import attention_inputs, packed_seq_params

from .rl_support import rl_config

REPO = Path(__file__).resolve().parents[2]


def test_packed_seq_params_follow_the_rows_cu_seqlens():
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int64)
    params = packed_seq_params(cu)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == params.cu_seqlens_kv.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 10, 12]
    assert params.max_seqlen_q == params.max_seqlen_kv == 7
    # the THD blocks are the dense mask's diagonal blocks: a token sees exactly its own sequence's past
    mask = ~step_math.block_diagonal_causal_mask(cu)[0, 0]
    for start, end in zip(params.cu_seqlens_q[:-1].tolist(), params.cu_seqlens_q[1:].tolist()):
        assert mask[start:end, start:end].equal(torch.ones(end - start, end - start, dtype=torch.bool).tril())
        assert not mask[start:end, :start].any() and not mask[start:end, end:].any()


def test_attention_inputs_give_exactly_what_the_attention_honours():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    mask, packed = attention_inputs("thd", cu)
    assert mask is None and packed.cu_seqlens_q.tolist() == [0, 2, 5] and packed.max_seqlen_q == 3
    mask, packed = attention_inputs("dense_mask", cu)
    assert packed is None and mask.equal(step_math.block_diagonal_causal_mask(cu))
    with pytest.raises(ValueError, match="must be 'thd' or 'dense_mask'"):
        attention_inputs("causal", cu)


def test_one_rollouts_tokens_do_not_move_the_other_rollouts_logprobs(tmp_path):
    """The real megatron-core policy on CPU (local spec, dense block-diagonal mask), router replay off so
    routing follows the tokens: replacing every token of the middle rollout leaves the first and the last
    rollouts' log-probs unchanged, while a plain causal mask (what an attention that ignores the dense
    mask would apply) lets the change leak into the last rollout. The same trainer (dr_grpo) refuses a
    rollout over its generation budget and a batch whose advantages another estimator computed."""
    config = rl_config(
        tmp_path / "policy.yaml", tmp_path / "run", "unused", replay="off", estimator="dr_grpo", max_generation_tokens=8
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.midtrain.packing_support", str(config), str(tmp_path / "out.json")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["attention"] == "dense_mask", "no Transformer Engine on CPU: the local spec, which applies the mask"
    first, middle, last = out["lengths"]
    logp, perturbed, leaky = (torch.tensor(out[k]) for k in ("logp", "logp_perturbed", "logp_perturbed_causal_only"))
    others = torch.cat([torch.arange(first), torch.arange(first + middle, first + middle + last)])
    torch.testing.assert_close(perturbed[others], logp[others], rtol=0, atol=1e-6)
    assert (perturbed[first + 1 : first + middle] - logp[first + 1 : first + middle]).abs().max() > 1e-3
    assert (leaky[first + middle + 1 :] - logp[first + middle + 1 :]).abs().max() > 1e-3, "the control must leak"
    assert "rollout r1 has more policy tokens than rl.max_generation_tokens 8" in out["budget_error"]
    assert "advantages are grpo's, rl.estimator is dr_grpo" in out["estimator_error"]
    assert out["logp_same_estimator"] == out["logp"], "a batch stamped with the configured estimator trains"
    assert out["logp_mixed"] == out["logp"], "product singles' baselines train next to the configured group estimator"
    assert "advantages are grpo's, rl.estimator is dr_grpo" in out["mixed_error"], "a foreign group estimator, per sample"
    assert "fused causal softmax" in out["fused_softmax_attention"] and "attend to each other" in out["fused_softmax_attention"]

