"""Dr.GRPO against GRPO: the loss normaliser by hand, and the estimator that pairs advantage and loss."""

from __future__ import annotations

import math

import pytest
import torch

from ember.configs import MidtrainConfigError, validate
from ember.midtrain.rl import step_math
from ember.midtrain.config import RLSettings
from ember.rollouts.advantages import dr_grpo_advantages, grpo_advantages

# two rollouts of one group: a (reward 1) has 2 policy tokens, b (reward 0) has 4; each starts with a
# prompt token that is never trained
CU = torch.tensor([0, 3, 8], dtype=torch.int32)
MASK = step_math.trainable_mask(torch.ones(8), CU)  # [0, 1, 1, 0, 1, 1, 1, 1]
SEQ = step_math.segment_ids(CU)


def _loss_and_grad(advantages: list[float], mode: str, max_tokens: int | None = None) -> tuple[float, list[float]]:
    """The PPO loss at ratio 1 (logp == old: per-token loss -A) and its gradient per token."""
    logp = torch.full((8,), -1.0, requires_grad=True)
    per_token, _ = step_math.ppo_clipped_loss(logp, torch.full((8,), -1.0), torch.tensor(advantages)[SEQ] * MASK, 0.2, 0.28)
    loss = step_math.aggregate(per_token, MASK, CU, mode, max_tokens=max_tokens)
    loss.backward()
    return float(loss.detach()), logp.grad.tolist()


def test_grpo_divides_each_rollout_by_its_length_dr_grpo_by_a_constant():
    s = 1 / math.sqrt(0.5)  # GRPO: (r - mean) / std with std = sqrt(0.5) (ddof 1) for rewards [1, 0]
    grpo = grpo_advantages([1.0, 0.0], epsilon=0.0)
    assert grpo.tolist() == pytest.approx([0.5 * s, -0.5 * s])
    loss, grad = _loss_and_grad(grpo.tolist(), "seq_mean")
    # (mean over a of -A_a + mean over b of -A_b) / 2 sequences = (-0.5 s + 0.5 s) / 2
    assert loss == pytest.approx(0.0)
    # a token of a weighs 1 / (2 tokens x 2 sequences), of b 1 / (4 x 2): the long wrong answer is
    # pushed down half as hard per token as the short right one is pushed up (the length bias)
    assert grad == pytest.approx([0, -0.5 * s / 4, -0.5 * s / 4, 0, 0.5 * s / 8, 0.5 * s / 8, 0.5 * s / 8, 0.5 * s / 8])

    dr = dr_grpo_advantages([1.0, 0.0])
    assert dr.tolist() == [0.5, -0.5]
    loss, grad = _loss_and_grad(dr.tolist(), "constant", max_tokens=5)
    # (2 x -0.5 + 4 x 0.5) / (5 max tokens x 2 sequences)
    assert loss == pytest.approx(1.0 / 10)
    # every policy token weighs 1 / 10, whatever its rollout's length
    assert grad == pytest.approx([0, -0.05, -0.05, 0, 0.05, 0.05, 0.05, 0.05])


def test_constant_normaliser_counts_every_sequence_and_needs_a_budget():
    per_token = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    only_a = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # b has no policy token but is still one of the group's samples: (2 + 3) / (4 x 2)
    assert float(step_math.aggregate(per_token, only_a, CU, "constant", max_tokens=4)) == pytest.approx(5 / 8)
    assert float(step_math.aggregate(per_token, only_a, CU, "token_mean")) == pytest.approx(5 / 2)
    with pytest.raises(ValueError, match="needs max_tokens > 0"):
        step_math.aggregate(per_token, only_a, CU, "constant")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_aggregate_terms_add_up_over_sequences(mode):
    """A batch split by whole sequences (as across data-parallel ranks) has the sums of its parts' terms."""
    per_token = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    whole = step_math.aggregate_terms(per_token, MASK, CU, mode, max_tokens=6)
    parts = [
        step_math.aggregate_terms(per_token[a:b], MASK[a:b], torch.tensor([0, b - a]), mode, max_tokens=6)
        for a, b in ((0, 3), (3, 8))
    ]
    assert float(whole[0]) == pytest.approx(sum(float(p[0]) for p in parts))
    assert float(whole[1]) == pytest.approx(sum(float(p[1]) for p in parts))
    assert float(step_math.aggregate(per_token, MASK, CU, mode, max_tokens=6)) == pytest.approx(float(whole[0] / whole[1]))


def test_generation_budget_names_the_first_rollout_over_it():
    assert step_math.check_generation_budget(MASK, CU, 4) is None
    assert step_math.check_generation_budget(MASK, CU, 3) == 1
    assert step_math.check_generation_budget(MASK, CU, 1) == 0


def test_the_estimator_picks_the_normaliser_and_refuses_a_mismatch():
    assert RLSettings(steps=1).aggregation == "token_mean"
    assert RLSettings(steps=1, estimator="grpo", aggregation="seq_mean").aggregation == "seq_mean"
    dr = RLSettings(steps=1, estimator="dr_grpo", max_generation_tokens=512)
    assert (dr.aggregation, dr.max_generation_tokens) == ("constant", 512)
    mismatched = [
        ({"estimator": "dr_grpo", "aggregation": "seq_mean", "max_generation_tokens": 8}, "aggregation", "dr_grpo needs aggregation constant"),
        ({"estimator": "dr_grpo", "aggregation": "token_mean", "max_generation_tokens": 8}, "aggregation", "dr_grpo needs aggregation constant"),
        ({"estimator": "grpo", "aggregation": "constant", "max_generation_tokens": 8}, "estimator", "set estimator: dr_grpo"),
        ({"estimator": "dr_grpo"}, "max_generation_tokens", "generation budget"),
        ({"estimator": "rloo", "max_generation_tokens": 8}, "max_generation_tokens", "only aggregation constant"),
    ]
    for fields, key, message in mismatched:
        with pytest.raises(MidtrainConfigError) as info:
            validate(RLSettings, {"steps": 1, **fields}, "config", MidtrainConfigError)
        assert f"{key}" in str(info.value) and message in str(info.value), (fields, str(info.value))
