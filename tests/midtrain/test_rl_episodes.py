"""The RL loss over a segmented episode, against hand-computed values and against the same episode written as
one long sequence: an episode's segments are separate packed sequences that share its advantage and its
normaliser (ember.midtrain.rl.step_math.aggregate_terms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.midtrain.rl import step_math
from ember.midtrain.rl.batch import episode_share_bounds, rl_batch
from ember.schemas import TrainBatch

# Episode A: three segments (4, 5 and 3 tokens; segments 2 and 3 open with the summary, context, no loss),
# advantage 0.5. Episode B: one segment of 4 tokens, advantage -0.25. Sequence starts are never trained.
SEGMENT_CU = torch.tensor([0, 4, 9, 12, 16], dtype=torch.int32)
LONG_CU = torch.tensor([0, 12, 16], dtype=torch.int32)  # A written as one sequence, then B
EPISODES = torch.tensor([0, 0, 0, 1])
MASK = torch.tensor([0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.float32)
ADVANTAGES = torch.tensor([0.5] * 12 + [-0.25] * 4)
RATIO = torch.linspace(0.9, 1.1, 16)  # pi / pi_old inside the clip range: the surrogate is -A r on every token
A_TOKENS, B_TOKENS = 6, 3
MAX_TOKENS = 8


def loss_and_grad(cu: torch.Tensor, mode: str, episodes: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    old = torch.zeros(16)
    logp = RATIO.log().clone().requires_grad_(True)
    per_token, _ = step_math.ppo_clipped_loss(logp, old, ADVANTAGES, 0.2, 0.2)
    loss = step_math.aggregate(per_token, MASK, cu, mode, max_tokens=MAX_TOKENS, episodes=episodes)
    loss.backward()
    return float(loss.detach()), logp.grad


def by_hand(weights: torch.Tensor) -> tuple[float, torch.Tensor]:
    """loss = sum over masked tokens of w_t (-A_t r_t); its gradient in log p_t is w_t (-A_t r_t) (dr/dlogp = r)."""
    terms = -ADVANTAGES * RATIO * MASK * weights
    return float(terms.sum()), terms


def test_token_mean_counts_each_of_the_episodes_tokens_once_and_equals_the_long_sequence():
    expected = by_hand(torch.full((16,), 1 / (A_TOKENS + B_TOKENS)))
    for cu, episodes in ((SEGMENT_CU, EPISODES), (LONG_CU, None)):
        loss, grad = loss_and_grad(cu, "token_mean", episodes)
        assert loss == pytest.approx(expected[0], rel=1e-6)
        assert torch.allclose(grad, expected[1], atol=1e-7)


def test_seq_mean_normalises_over_the_whole_episode_as_over_the_long_sequence_not_per_segment():
    weights = torch.cat([torch.full((12,), 1 / (A_TOKENS * 2)), torch.full((4,), 1 / (B_TOKENS * 2))])
    expected = by_hand(weights)
    segmented, long = loss_and_grad(SEGMENT_CU, "seq_mean", EPISODES), loss_and_grad(LONG_CU, "seq_mean")
    for loss, grad in (segmented, long):
        assert loss == pytest.approx(expected[0], rel=1e-6)
        assert torch.allclose(grad, expected[1], atol=1e-7)
    per_segment = loss_and_grad(SEGMENT_CU, "seq_mean")  # what treating segments as unrelated rollouts would give
    assert per_segment[0] != pytest.approx(expected[0], rel=1e-3)


def test_constant_normaliser_stays_global_one_weight_for_every_token_of_every_segment():
    """Dr.GRPO divides by max_tokens x sequences, max_tokens being each context's generation budget: every token
    of the batch has the same weight, so the segmented and the long form differ by the count of contexts only."""
    segmented_loss, segmented_grad = loss_and_grad(SEGMENT_CU, "constant", EPISODES)
    expected = by_hand(torch.full((16,), 1 / (MAX_TOKENS * 4)))
    assert segmented_loss == pytest.approx(expected[0], rel=1e-6)
    assert torch.allclose(segmented_grad, expected[1], atol=1e-7)
    long_loss, long_grad = loss_and_grad(LONG_CU, "constant")
    assert torch.allclose(long_grad, segmented_grad * 4 / 2, atol=1e-7)
    assert long_loss == pytest.approx(segmented_loss * 2, rel=1e-6)


def test_a_batchs_episode_ids_number_its_sequences_and_ranks_never_split_an_episode():
    batch = TrainBatch(
        batch_id="b", step=0, tokens=np.arange(16, dtype=np.uint32), loss_mask=MASK.numpy().astype(np.uint8),
        advantages=ADVANTAGES.numpy(), sampler_logprobs=np.zeros(16, np.float32), cu_seqlens=SEGMENT_CU.numpy(),
        policy_versions=np.zeros(4, np.int64), rollout_ids=["a0", "a1", "a2", "b0"], episode_ids=["a", "a", "a", "b"],
    ).validate()
    assert rl_batch(batch).episodes.tolist() == [0, 0, 0, 1]
    assert episode_share_bounds(batch.cu_seqlens, batch.episode_ids, 2).tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="2 episodes for 3 data-parallel ranks"):
        episode_share_bounds(batch.cu_seqlens, batch.episode_ids, 3)
    plain = TrainBatch(**{**vars(batch), "episode_ids": []})
    assert rl_batch(plain).episodes is None
    assert episode_share_bounds(plain.cu_seqlens, [], 2).tolist() == [0, 2, 4]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "constant"])
def test_terms_of_shares_cut_between_episodes_add_up_to_the_batchs(mode):
    """What data-parallel ranks rely on: a share of whole episodes has its part of the numerator and denominator."""
    per_token = -ADVANTAGES * RATIO
    whole = step_math.aggregate_terms(per_token, MASK, SEGMENT_CU, mode, max_tokens=MAX_TOKENS, episodes=EPISODES)
    first = step_math.aggregate_terms(per_token[:12], MASK[:12], SEGMENT_CU[:4], mode, max_tokens=MAX_TOKENS, episodes=EPISODES[:3])
    second = step_math.aggregate_terms(per_token[12:], MASK[12:], SEGMENT_CU[3:] - 12, mode, max_tokens=MAX_TOKENS, episodes=EPISODES[3:] - 1)
    assert float(first[0] + second[0]) == pytest.approx(float(whole[0]), rel=1e-6)
    assert float(first[1] + second[1]) == pytest.approx(float(whole[1]), rel=1e-6)
