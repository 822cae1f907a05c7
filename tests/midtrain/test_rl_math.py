"""The RL step's math against hand-computed values."""

import math

import pytest
import torch

from ember.midtrain.rl import step_math

CU = torch.tensor([0, 3, 5], dtype=torch.int32)  # two sequences: tokens 0-2 and 3-4


def test_packing_helpers_keep_sequences_apart():
    tokens = torch.tensor([10, 11, 12, 20, 21])
    assert step_math.segment_ids(CU).tolist() == [0, 0, 0, 1, 1]
    assert step_math.next_token_labels(tokens, CU).tolist() == [11, 12, 12, 21, 21]
    # model output at t predicts t+1; the shift puts it on the predicted token, starts get 0
    next_logp = torch.tensor([-1.0, -2.0, -9.0, -3.0, -9.0])
    assert step_math.token_logprobs(next_logp, CU).tolist() == [0.0, -1.0, -2.0, 0.0, -3.0]
    assert step_math.trainable_mask(torch.tensor([1, 1, 1, 1, 0]), CU).tolist() == [0, 1, 1, 0, 0]
    mask = step_math.block_diagonal_causal_mask(CU)[0, 0]
    expected = torch.tensor(
        [
            [0, 1, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1],
            [1, 1, 1, 0, 1],
            [1, 1, 1, 0, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_mismatch_metrics_by_hand():
    log_rho = torch.tensor([0.0, math.log(1.9), math.log(0.25), 5.0])
    sampler = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is not a policy token
    m = step_math.mismatch_metrics(sampler + log_rho, sampler, mask, alpha=0.5, beta=2.0, cap=1.5)
    assert m["mean_abs_delta_logp"] == pytest.approx((0 + math.log(1.9) + math.log(4)) / 3)
    assert m["kl_k1"] == pytest.approx((0 - math.log(1.9) + math.log(4)) / 3)
    assert m["rho_mean"] == pytest.approx((1 + 1.9 + 0.25) / 3) and m["frac_above_cap"] == pytest.approx(1 / 3)
    assert (m["rho_min"], m["rho_max"]) == pytest.approx((0.25, 1.9))  # the masked-out token (rho = e^5) is not seen
    # k3: rho - 1 - log rho = 0, 0.9 - ln 1.9, -0.75 + ln 4
    assert m["kl_mu_pi"] == pytest.approx((0 + (0.9 - math.log(1.9)) + (-0.75 + math.log(4))) / 3, rel=1e-6)
    assert m["frac_outside"] == pytest.approx(1 / 3)  # rho = 1.9 is inside [0.5, 2], 0.25 is not
    assert m["max_abs_delta_logp"] == pytest.approx(math.log(4))


def test_corrections_by_hand():
    log_rho = torch.log(torch.tensor([0.25, 1.0, 3.0, 1.5, 1.5]))
    mask = torch.ones(5)
    weights = step_math.correction_weights("tis", log_rho, mask, CU, cap=2.0, alpha=0.5, beta=2.0)
    assert weights.tolist() == pytest.approx([0.25, 1.0, 2.0, 1.5, 1.5])
    weights = step_math.correction_weights("mis", log_rho, mask, CU, cap=2.0, alpha=0.5, beta=2.0)
    assert weights.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    # sequence 0: geometric mean (0.25 * 1 * 3)^(1/3) = 0.909 -> kept; sequence 1: 1.5 -> kept
    weights = step_math.correction_weights("seq_geo", log_rho, mask, CU, cap=2.0, alpha=0.5, beta=2.0)
    assert weights.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    # tighter bounds: sequence 0 (0.909) outside [0.95, 1.6], sequence 1 (1.5) inside
    weights = step_math.correction_weights("seq_geo", log_rho, mask, CU, cap=2.0, alpha=0.95, beta=1.6)
    assert weights.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    # only policy tokens count toward rho_seq: masking the 0.25 token gives sqrt(3) = 1.73 > 1.6
    partial = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    weights = step_math.correction_weights("seq_geo", log_rho, partial, CU, cap=2.0, alpha=0.95, beta=1.6)
    assert weights.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert step_math.correction_weights("none", log_rho, mask, CU, cap=2.0, alpha=0.5, beta=2.0).tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="correction must be one of"):
        step_math.correction_weights("bogus", log_rho, mask, CU, cap=2.0, alpha=0.5, beta=2.0)


def test_ppo_clipped_loss_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -2.0, 1.0])
    loss, clipped = step_math.ppo_clipped_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # r=1.5,A=1: min(1.5, 1.28) = 1.28 (clipped); r=1.5,A=-1: min(-1.5, -1.28) = -1.5 (unclipped)
    # r=0.5,A=-2: min(-1.0, -1.6) = -1.6 (clipped); r=1.1,A=1: 1.1 (inside)
    assert loss.tolist() == pytest.approx([-1.28, 1.5, 1.6, -1.1])
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    loss.sum().backward()
    # d(-r A)/d logp = -r A where unclipped, 0 where clipped
    assert logp.grad.tolist() == pytest.approx([0.0, 1.5, 0.0, -1.1])


def test_aggregation_token_mean_and_seq_mean():
    per_token = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    assert float(step_math.aggregate(per_token, mask, CU, "token_mean")) == pytest.approx((2 + 3 + 20) / 3)
    assert float(step_math.aggregate(per_token, mask, CU, "seq_mean")) == pytest.approx((2.5 + 20) / 2)
    # a sequence without policy tokens does not count
    none_in_second = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0])
    assert float(step_math.aggregate(per_token, none_in_second, CU, "seq_mean")) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        step_math.aggregate(per_token, mask, CU, "sum")


def test_routing_disagreement_ignores_top_k_order():
    sampler = torch.tensor([[0, 1], [2, 3], [1, 3]], dtype=torch.uint8)
    same = step_math.expert_map(torch.tensor([[1, 0], [3, 2], [3, 1]]), 4)
    assert step_math.routing_disagreement(same, sampler) == 0.0
    one_flip = step_math.expert_map(torch.tensor([[1, 0], [3, 0], [3, 1]]), 4)
    assert step_math.routing_disagreement(one_flip, sampler) == pytest.approx(1 / 3)


def test_repeated_experts_within_a_token_are_detected():
    assert not step_math.repeats_an_expert(torch.tensor([[[0, 1], [3, 2]], [[1, 0], [2, 3]]]))
    assert step_math.repeats_an_expert(torch.tensor([[[0, 1], [3, 2]], [[1, 1], [2, 3]]]))
