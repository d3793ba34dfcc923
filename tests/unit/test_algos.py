"""Hand-computed checks of trainer/algos.py, plus the micro-batch invariance of every loss aggregation.

Each expected number is worked out in the comment next to it; tolerances are tight (atol 1e-6 in fp32,
1e-12 in fp64) so an off-by-one in a denominator or a wrong clip branch fails.
"""

import math

import pytest
import torch

from trainer import algos

F32 = {"atol": 1e-6, "rtol": 0.0}
F64 = {"atol": 1e-12, "rtol": 0.0}


def t32(values):
    return torch.tensor(values, dtype=torch.float32)


def t64(values):
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------------------------ masked stats


def test_masked_mean_var_whiten_ignore_padding():
    x = t32([[1.0, 2.0, 3.0, 100.0]])
    mask = t32([[1, 1, 1, 0]])
    # mean of 1, 2, 3 = 2; unbiased var = (1 + 0 + 1) / (3 - 1) = 1
    torch.testing.assert_close(algos.masked_mean(x, mask), torch.tensor(2.0), **F32)
    torch.testing.assert_close(algos.masked_var(x, mask), torch.tensor(1.0), **F32)
    # (x - 2) / sqrt(1 + 1e-8) = -1, 0, 1; padding -> 0 (not (100 - 2) / 1)
    torch.testing.assert_close(algos.masked_whiten(x, mask), t32([[-1.0, 0.0, 1.0, 0.0]]), **F32)


def test_masked_mean_per_row_and_degenerate_masks_give_zero_not_nan():
    x = t32([[1.0, 3.0], [5.0, 7.0]])
    # row 0: (1 + 3) / 2 = 2; row 1: only 7 -> 7
    torch.testing.assert_close(algos.masked_mean(x, t32([[1, 1], [0, 1]]), dim=-1), t32([2.0, 7.0]), **F32)
    assert algos.masked_mean(x, torch.zeros(2, 2)).item() == 0.0
    # a single masked value: centred value is 0 whatever the (undefined) variance
    whitened = algos.masked_whiten(x, t32([[0, 1], [0, 0]]))
    assert torch.isfinite(whitened).all() and whitened.abs().max().item() == 0.0


# ------------------------------------------------------------------------------------ GRPO / RLOO

# Three groups, interleaved, ids not contiguous:
#   group 5: scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350
#   group 9: scores 2, 4       -> mean 3,   unbiased std sqrt((1 + 1) / 1) = sqrt(2)     = 1.414214
#   group 2: score 0.3 alone   -> verl: mean 0, std 1
SCORES = t32([1.0, 0.0, 2.0, 0.0, 4.0, 1.0, 0.3])
GROUPS = torch.tensor([5, 5, 9, 5, 9, 5, 2])
MASK = t32([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    adv = algos.grpo_advantages(SCORES, GROUPS, MASK)
    s5 = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.866024
    s9 = 1.0 / (math.sqrt(2) + 1e-6)  # 0.707106
    alone = 0.3 / (1 + 1e-6)  # 0.2999997
    per_seq = t32([s5, -s5, -s9, -s5, s9, s5, alone])
    torch.testing.assert_close(adv, per_seq.unsqueeze(-1) * MASK, **F32)
    assert adv[1, 2].item() == 0.0 and adv[2, 1].item() == 0.0  # padding stays 0


def test_dr_grpo_only_subtracts_the_group_mean():
    adv = algos.grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False)
    # 1 - 0.5, 0 - 0.5, 2 - 3, 0 - 0.5, 4 - 3, 1 - 0.5, 0.3 - 0 (group of one: mean 0)
    per_seq = t32([0.5, -0.5, -1.0, -0.5, 1.0, 0.5, 0.3])
    torch.testing.assert_close(adv, per_seq.unsqueeze(-1) * MASK, **F32)


def test_grpo_all_equal_group_gives_zero_not_nan():
    adv = algos.grpo_advantages(t32([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 2))
    # (1 - 1) / (0 + 1e-6) = 0
    torch.testing.assert_close(adv, torch.zeros(2, 2), **F32)


def test_equal_scores_give_exactly_zero_advantage_even_when_their_float_mean_is_off():
    # Six fp32 scores of 0.3: their float mean is 0.3 - 2.98e-8, so the textbook formula gives each
    # (2.98e-8) / (std 3.3e-8 + 1e-6) = +0.0289 (verl's value too). The control shows that bug:
    scores = t32([0.3] * 6)
    textbook = (scores - scores.mean()) / (scores.std() + 1e-6)
    assert textbook.min().item() > 0.028
    # A second group of 0.3s next to a group that varies, ids interleaved:
    scores = t32([0.3, 1.0, 0.3, 0.0, 0.3, 0.3, 0.3, 0.3])
    groups = torch.tensor([4, 7, 4, 7, 4, 4, 4, 4])
    mask = torch.ones(8, 2)
    for advantages in (
        algos.grpo_advantages(scores, groups, mask),
        algos.rloo_advantages(scores, groups, mask),
        algos.reinforce_plus_plus_baseline_advantages(scores, groups, mask),
    ):
        assert advantages[groups == 4].abs().max().item() == 0.0  # exactly, not within a tolerance
    # group 7 is untouched: (1 - 0.5) / (sqrt(0.5) + 1e-6) = 0.707106
    grpo = algos.grpo_advantages(scores, groups, mask)
    torch.testing.assert_close(grpo[1], t32([0.707106] * 2), **F32)
    mean, std, _ = algos.group_stats(scores, groups)
    assert mean[0].item() == scores[0].item() and std[0].item() == 0.0


def test_rloo_subtracts_the_mean_of_the_others():
    adv = algos.rloo_advantages(SCORES, GROUPS, MASK)
    # group 5: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3   (= 4/3 * (+-0.5))
    # group 9: 2 - 4 = -2; 4 - 2 = 2.   group of one: no baseline -> 0.3
    per_seq = t32([2 / 3, -2 / 3, -2.0, -2 / 3, 2.0, 2 / 3, 0.3])
    torch.testing.assert_close(adv, per_seq.unsqueeze(-1) * MASK, **F32)


def test_group_stats_and_input_validation():
    mean, std, size = algos.group_stats(SCORES, GROUPS)
    torch.testing.assert_close(mean, t32([0.5, 0.5, 3.0, 0.5, 3.0, 0.5, 0.3]), **F32)
    torch.testing.assert_close(std[:2], t32([math.sqrt(1 / 3)] * 2), **F32)
    assert std[6].item() == 0.0 and size.tolist() == [4, 4, 2, 4, 2, 4, 1]
    with pytest.raises(ValueError, match="response_mask"):
        algos.grpo_advantages(SCORES, GROUPS, MASK[:3])
    with pytest.raises(ValueError, match="group_ids"):
        algos.rloo_advantages(SCORES, GROUPS[:3], MASK)


# ------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_whitens_discounted_returns():
    rewards = t32([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = t32([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5. row 0: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.25. row 1: G1 = 2, G0 = 0.5 * 2 = 1
    returns = algos.discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, t32([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), **F32)
    # whiten over 0.25, 0.5, 1, 1, 2: mean 0.95, unbiased var (0.49 + 0.2025 + 0.0025 * 2 + 1.1025) / 4 = 0.45
    # std 0.670820: -0.7 / std = -1.043498, -0.45 / std = -0.670820,
    #               0.05 / std = 0.074536, 1.05 / std = 1.565248
    adv = algos.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    expected = t32([[-1.0434984, -0.6708204, 0.0745356], [0.0745356, 1.5652476, 0.0]])
    torch.testing.assert_close(adv, expected, **F32)


def test_discounted_returns_skip_masked_tool_tokens():
    # token 1 is tool output (mask 0): it neither adds its reward (5) nor discounts.
    # G2 = 1; G1 carries 1 (masked -> reported as 0); G0 = 0 + 0.5 * 1 = 0.5
    returns = algos.discounted_returns(t32([[0.0, 5.0, 1.0]]), t32([[1, 0, 1]]), gamma=0.5)
    torch.testing.assert_close(returns, t32([[0.5, 0.0, 1.0]]), **F32)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens_batch():
    scores = t32([1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 1])
    mask = t32([[1, 1], [1, 0], [1, 1]])
    # group 0 mean 0.5 -> 0.5, -0.5; group 1 alone (mean 0) -> 3. Per token: 0.5, 0.5 | -0.5 | 3, 3
    # mean 6.5 / 5 = 1.3; unbiased var (0.64 + 0.64 + 3.24 + 2.89 + 2.89) / 4 = 2.575, std 1.604681
    # -0.8 / std = -0.498542, -1.8 / std = -1.121719, 1.7 / std = 1.059401
    adv = algos.reinforce_plus_plus_baseline_advantages(scores, groups, mask)
    expected = t32([[-0.4985416, -0.4985416], [-1.1217185, 0.0], [1.0594008, 1.0594008]])
    torch.testing.assert_close(adv, expected, **F32)


# --------------------------------------------------------------------------------------------- GAE


def test_gae_returns_and_whitened_advantages_with_masking():
    rewards = t64([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    values = t64([[0.5, 0.4, 0.6], [0.2, 9.9, 0.5]])
    mask = t64([[1, 1, 1], [1, 0, 1]])  # row 1, token 1: tool output, its value 9.9 must not be used
    advantages, returns = algos.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: d2 = 1 - 0.6 = 0.4,            A2 = 0.4
    #        d1 = 0.9 * 0.6 - 0.4 = 0.14,   A1 = 0.14 + 0.45 * 0.4 = 0.32
    #        d0 = 0.9 * 0.4 - 0.5 = -0.14,  A0 = -0.14 + 0.45 * 0.32 = 0.004
    # row 1: d2 = 2 - 0.5 = 1.5,            A2 = 1.5; token 1 skipped (next value stays 0.5, A stays 1.5)
    #        d0 = 0.9 * 0.5 - 0.2 = 0.25,   A0 = 0.25 + 0.45 * 1.5 = 0.925
    # returns = A + V: 0.504, 0.72, 1.0 | 1.125, (masked) 0, 2.0
    torch.testing.assert_close(returns, t64([[0.504, 0.72, 1.0], [1.125, 0.0, 2.0]]), **F64)
    # whiten 0.004, 0.32, 0.4, 0.925, 1.5: mean 0.6298, unbiased var 1.3848008 / 4 = 0.3462002
    std = math.sqrt(0.3462002 + 1e-8)
    raw = t64([[0.004, 0.32, 0.4], [0.925, 0.6298, 1.5]])  # masked slot -> (0.6298 - 0.6298) = 0
    torch.testing.assert_close(advantages, (raw - 0.6298) / std * mask, **F64)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value():
    # gamma = lam = 1, values 0: every token's advantage is the final reward 3 (before whitening)
    _, returns = algos.gae_advantages(
        t64([[0.0, 0.0, 3.0]]),
        torch.zeros(1, 3, dtype=torch.float64),
        torch.ones(1, 3, dtype=torch.float64),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(returns, t64([[3.0, 3.0, 3.0]]), **F64)


def test_scores_land_on_the_last_response_token():
    mask = t32([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    rewards = algos.scores_to_token_rewards(t32([1.0, 2.0, 3.0, 4.0]), mask)
    # last masked index: 1, 2, none (no reward), 2
    torch.testing.assert_close(rewards, t32([[0, 1, 0], [0, 0, 2], [0, 0, 0], [0, 0, 4]]), **F32)


# ---------------------------------------------------------------------------------------------- KL


def test_kl_penalty_kinds():
    logprobs = t32([-1.0, -2.0])
    ref_logprobs = t32([-1.5, -1.0])  # log pi / pi_ref = 0.5, -1.0
    torch.testing.assert_close(algos.kl_penalty(logprobs, ref_logprobs, "k1"), t32([0.5, -1.0]), **F32)
    torch.testing.assert_close(algos.kl_penalty(logprobs, ref_logprobs, "abs"), t32([0.5, 1.0]), **F32)
    # k2: 0.5 * 0.25, 0.5 * 1
    torch.testing.assert_close(algos.kl_penalty(logprobs, ref_logprobs, "k2"), t32([0.125, 0.5]), **F32)
    # k3 with x = log pi_ref / pi = -0.5, 1.0: e^x - x - 1 = 0.606531 + 0.5 - 1 = 0.106531; e - 2 = 0.718282
    torch.testing.assert_close(
        algos.kl_penalty(logprobs, ref_logprobs, "k3"), t32([0.1065307, 0.7182818]), **F32
    )
    for alias, name in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        torch.testing.assert_close(
            algos.kl_penalty(logprobs, ref_logprobs, alias),
            algos.kl_penalty(logprobs, ref_logprobs, name),
            **F32,
        )
    with pytest.raises(ValueError, match="unknown KL kind 'k4'"):
        algos.kl_penalty(logprobs, ref_logprobs, "k4")


def test_low_var_kl_is_clamped_to_ten():
    # x = +30 -> clamp 20 -> e^20 - 21 = 4.85e8 -> 10;  x = -30 -> clamp -20 -> e^-20 + 19 = 19.0 -> 10
    kl = algos.kl_penalty(t32([-30.0, 0.0]), t32([0.0, -30.0]), "low_var_kl")
    torch.testing.assert_close(kl, t32([10.0, 10.0]), **F32)


def test_kl_in_reward_penalises_only_response_tokens():
    token_scores = t32([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref_logprobs = t32([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    logprobs = ref_logprobs + t32([[0.2, -0.1, 0.3], [0.5, 0.5, 7.0]])  # k1 per token; 7.0 is padding
    mask = t32([[1, 1, 1], [1, 1, 0]])
    rewards, seq_kl = algos.apply_kl_in_reward(token_scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    # score - 0.1 * kl: -0.02, 0.01, 1 - 0.03 | -0.05, 2 - 0.05, 0 (padding untouched)
    torch.testing.assert_close(rewards, t32([[-0.02, 0.01, 0.97], [-0.05, 1.95, 0.0]]), **F32)
    # per-sequence mean kl: (0.2 - 0.1 + 0.3) / 3 = 0.133333; (0.5 + 0.5) / 2 = 0.5
    torch.testing.assert_close(seq_kl, t32([0.4 / 3, 0.5]), **F32)


def test_fixed_kl_controller_never_moves():
    controller = algos.FixedKLController(0.001)
    controller.update(current_kl=5.0, n_steps=256)
    assert controller.value == 0.001


def test_adaptive_kl_controller_is_proportional_and_clipped():
    controller = algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    controller.update(
        current_kl=0.055, n_steps=100
    )  # error 0.055 / 0.05 - 1 = 0.1 -> x (1 + 0.1 * 0.1) = 0.101
    assert controller.value == pytest.approx(0.101, abs=1e-12)
    controller.update(current_kl=1.0, n_steps=100)  # error 19 -> clipped 0.2 -> x 1.02 = 0.10302
    assert controller.value == pytest.approx(0.10302, abs=1e-12)
    controller.update(current_kl=0.0, n_steps=500)  # error -1 -> clipped -0.2 -> x (1 - 0.1) = 0.092718
    assert controller.value == pytest.approx(0.092718, abs=1e-12)
    with pytest.raises(ValueError, match="horizon"):
        algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=0)


# ------------------------------------------------------------------------------------- aggregation

LOSS = t32([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])  # 99 is padding
LOSS_MASK = t32([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 3.0),  # (1 + 2 + 3 + 4 + 5) / 5
        ("token-mean", {"num_tokens": 10}, 1.5),  # 15 / 10 (global count)
        ("seq-mean-token-sum", {}, 7.5),  # (6 + 9) / 2
        ("seq-mean-token-sum", {"num_seqs": 4}, 3.75),  # 15 / 4
        ("seq-mean-token-mean", {}, 3.25),  # (6 / 3 + 9 / 2) / 2 = (2 + 4.5) / 2
        ("seq-mean-token-mean", {"num_seqs": 5}, 1.3),  # 6.5 / 5
        ("seq-mean-token-sum-norm", {}, 2.5),  # (6 / 3 + 9 / 3) / 2, T = 3
        ("seq-mean-token-sum-norm", {"max_response_len": 5}, 1.5),  # (6 / 5 + 9 / 5) / 2
        ("seq-mean-token-sum-norm", {"max_response_len": 5, "num_seqs": 3}, 1.0),  # 3 / 3
    ],
)
def test_aggregate_loss_modes(mode, kwargs, expected):
    torch.testing.assert_close(
        algos.aggregate_loss(LOSS, LOSS_MASK, mode, **kwargs), torch.tensor(expected), **F32
    )


def test_aggregate_loss_empty_sequence_and_bad_arguments():
    # A row with no loss token adds 0 (not 0 / 0) and is not counted, as in verl:
    # (6 / 3) / 1 = 2, not (6 / 3 + 0) / 2 = 1, in every seq-mean mode
    no_tokens = t32([[1, 1, 1], [0, 0, 0]])
    assert algos.count_loss_sequences(no_tokens).item() == 1
    for mode, expected in (("seq-mean-token-mean", 2.0), ("seq-mean-token-sum", 6.0)):
        torch.testing.assert_close(algos.aggregate_loss(LOSS, no_tokens, mode), torch.tensor(expected), **F32)
    # seq-mean-token-sum-norm: (6 / 3) / 1 = 2
    loss = algos.aggregate_loss(LOSS, no_tokens, "seq-mean-token-sum-norm")
    torch.testing.assert_close(loss, torch.tensor(2.0), **F32)
    assert algos.aggregate_loss(LOSS, torch.zeros(2, 3), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-mean'"):
        algos.aggregate_loss(LOSS, LOSS_MASK, "seq-mean")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        algos.aggregate_loss(LOSS, LOSS_MASK, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="same shape"):
        algos.aggregate_loss(LOSS, LOSS_MASK[:, :2], "token-mean")


# ------------------------------------------------------------------------------------- policy loss


def _policy_case():
    """Six one-token sequences, one per clip branch (clip_ratio_low 0.2, clip_ratio_high 0.28, c 3)."""
    # (ratio, A); loss per token = max(-A * ratio, -A * clip(ratio, 0.8, 1.28)), then min(., -3 A) if A < 0
    cases = [
        (1.1, 1.0),  # a: inside the band         -> -1.1, gradient flows
        (1.5, 1.0),  # b: above 1.28, A > 0       -> max(-1.5, -1.28) = -1.28 (high clip), no gradient
        (0.5, -1.0),  # c: below 0.8, A < 0       -> max(0.5, 0.8) = 0.8 (low clip), no gradient
        (5.0, -1.0),  # d: ratio exploded, A < 0  -> max(5, 1.28) = 5, dual clip min(5, 3) = 3
        (0.5, 2.0),  # e: below 0.8 but A > 0     -> max(-1.0, -1.6) = -1.0, unclipped
        (1.1, -1.0),  # f: inside the band, A < 0 -> 1.1, gradient flows
    ]
    ratio = t32([[r] for r, _ in cases])
    advantages = t32([[a] for _, a in cases])
    old_logprobs = t32([[-1.0]] * 6)
    logprobs = (old_logprobs + ratio.log()).requires_grad_(True)
    return logprobs, old_logprobs, advantages


def test_ppo_policy_loss_clip_branches():
    logprobs, old_logprobs, advantages = _policy_case()
    mask = torch.ones(6, 1)
    out = algos.ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    # token-mean of -1.1, -1.28, 0.8, 3, -1.0, 1.1 = 1.52 / 6
    torch.testing.assert_close(out.loss, torch.tensor(1.52 / 6), **F32)
    out.loss.backward()
    # d loss / d logprob = -A * ratio / 6 where unclipped (a, e, f), 0 where a clip set the loss
    expected_grad = t32([[-1.1], [0.0], [0.0], [0.0], [-1.0], [1.1]]) / 6
    torch.testing.assert_close(logprobs.grad, expected_grad, **F32)
    # clipfrac: clipped loss > unclipped at b (-1.28 > -1.5) and c (0.8 > 0.5) -> 2/6; dual clip at d -> 1/6
    torch.testing.assert_close(out.clipfrac, torch.tensor(2 / 6), **F32)
    torch.testing.assert_close(out.clipfrac_lower, torch.tensor(1 / 6), **F32)
    # ppo_kl = mean(-log ratio) = -(2 ln 1.1 + ln 1.5 + 2 ln 0.5 + ln 5) / 6
    approx_kl = -(2 * math.log(1.1) + math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 6
    torch.testing.assert_close(out.approx_kl, torch.tensor(approx_kl), **F32)


def test_ppo_symmetric_clip_and_masked_tokens():
    logprobs, old_logprobs, advantages = _policy_case()
    mask = t32([[1], [1], [0], [0], [0], [0]])  # only a and b count
    out = algos.ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    # a: -1.1; b: clipped at 1 + 0.2 -> -1.2. mean = -2.3 / 2
    torch.testing.assert_close(out.loss, torch.tensor(-1.15), **F32)
    torch.testing.assert_close(out.clipfrac, torch.tensor(0.5), **F32)
    assert out.clipfrac_lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_c=1.0)


def test_ppo_policy_loss_passes_the_aggregation_through():
    logprobs, old_logprobs, advantages = _policy_case()
    out = algos.ppo_policy_loss(
        logprobs.view(2, 3),
        old_logprobs.view(2, 3),
        advantages.view(2, 3),
        torch.ones(2, 3),
        clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-sum",
        num_seqs=4,
    )
    # sequence sums: -1.1 - 1.28 + 0.8 = -1.58; 3 - 1.0 + 1.1 = 3.1 -> 1.52 / 4 (global num_seqs)
    torch.testing.assert_close(out.loss, torch.tensor(0.38), **F32)


def test_ratio_is_finite_for_huge_log_ratio():
    out = algos.ppo_policy_loss(
        t32([[100.0]]), t32([[0.0]]), t32([[1.0]]), t32([[1.0]]), clip_ratio_high=0.28
    )
    # log ratio clamped to 20; A > 0 so the high clip sets the loss: -1.28
    torch.testing.assert_close(out.loss, torch.tensor(-1.28), **F32)
    torch.testing.assert_close(out.approx_kl, torch.tensor(-20.0), **F32)


def test_value_loss_clipping():
    values = t32([[2.0, 0.0, 1.0, 2.0]]).requires_grad_(True)
    old_values = t32([[1.0, 1.0, 1.0, 1.0]])
    returns = t32([[3.0, 0.0, 0.0, 1.2]])
    # clip to old +- 0.5:  1.5, 0.5, 1.0, 1.5
    # t0: max((2 - 3)^2 = 1, (1.5 - 3)^2 = 2.25) = 2.25 (clipped)   t1: max(0, 0.25) = 0.25 (clipped)
    # t2: both 1 -> 1                                              t3: max(0.64, 0.09) = 0.64
    loss, clipfrac = algos.value_loss(values, old_values, returns, torch.ones(1, 4), cliprange_value=0.5)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 4.14 / 4), **F32)  # 0.5 * token-mean
    torch.testing.assert_close(clipfrac, torch.tensor(0.5), **F32)
    loss.backward()
    # clipped tokens get no gradient; t2: 0.5 * 2 (1 - 0) / 4 = 0.25; t3: 0.5 * 2 (2 - 1.2) / 4 = 0.2
    torch.testing.assert_close(values.grad, t32([[0.0, 0.0, 0.25, 0.2]]), **F32)


# ----------------------------------------------------------------------------------------- entropy


def test_entropy_from_logits():
    uniform = torch.full((2, 3, 8), 3.7)
    # uniform over 8 -> log 8 = 2.0794415, whatever the constant
    torch.testing.assert_close(algos.entropy_from_logits(uniform), torch.full((2, 3), math.log(8)), **F32)
    one_hot = 1e4 * torch.nn.functional.one_hot(torch.tensor([0, 5]), 8).float()
    torch.testing.assert_close(algos.entropy_from_logits(one_hot), torch.zeros(2), **F32)
    # p = softmax(0, ln 3) = (1/4, 3/4): H = 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    two_way = torch.tensor([0.0, math.log(3.0)])
    torch.testing.assert_close(algos.entropy_from_logits(two_way), torch.tensor(0.5623351), **F32)
    # no overflow for large logits; bf16 input -> fp32 output
    big = torch.tensor([1000.0, 1000.0], dtype=torch.bfloat16)
    entropy = algos.entropy_from_logits(big)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, torch.tensor(math.log(2)), **F32)


# ----------------------------------------------------------------------- micro-batch invariance


def _toy_policy_batch(seed=0, batch=8, length=6, vocab=5, features=4):
    """A linear policy over random features: logprobs/entropy differentiable in one weight matrix."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(features, vocab, generator=generator, dtype=torch.float64, requires_grad=True)
    inputs = torch.randn(batch, length, features, generator=generator, dtype=torch.float64)
    tokens = torch.randint(vocab, (batch, length), generator=generator)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 2])  # uneven, so token counts differ per micro-batch
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).to(torch.float64)
    with torch.no_grad():
        logits = inputs @ weight
        base = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # old/ref logprobs off-policy by up to +-0.5 so every clip branch occurs
    old_logprobs = base + (torch.rand(batch, length, generator=generator, dtype=torch.float64) - 0.5)
    ref_logprobs = base + 0.3 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, length, generator=generator, dtype=torch.float64) * 2
    return weight, {
        "inputs": inputs,
        "tokens": tokens,
        "mask": mask,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "advantages": advantages,
    }


def _actor_loss(weight, batch, mode, **denominators):
    """pg loss + 0.1 * k3 KL loss - 0.01 * entropy, as the actor worker combines them."""
    logits = batch["inputs"] @ weight
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
    policy = algos.ppo_policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["mask"],
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=mode,
        **denominators,
    )
    kl = algos.kl_penalty(logprobs, batch["ref_logprobs"], "low_var_kl")
    entropy = algos.entropy_from_logits(logits).to(torch.float64)
    return (
        policy.loss
        + 0.1 * algos.aggregate_loss(kl, batch["mask"], mode, **denominators)
        - 0.01 * algos.aggregate_loss(entropy, batch["mask"], mode, **denominators)
    )


def _micro_batches(batch, sizes):
    """Split rows, then trim each micro-batch's padding to its own longest response (dynamic padding)."""
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        width = int(batch["mask"][rows].sum(-1).max())
        yield {key: value[rows, :width] for key, value in batch.items()}
        start += size


def _accumulate(weight, batch, mode, sizes, **denominators):
    weight.grad = None
    total = 0.0
    for micro in _micro_batches(batch, sizes):
        loss = _actor_loss(weight, micro, mode, **denominators)
        loss.backward()  # gradients accumulate across micro-batches
        total = total + loss.detach()
    return total, weight.grad.clone()


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("sizes", [[1] * 8, [3, 1, 4], [8]])
def test_micro_batch_losses_and_gradients_sum_to_the_mini_batch(mode, sizes):
    weight, batch = _toy_policy_batch()
    denominators = {"num_tokens": batch["mask"].sum(), "num_seqs": 8, "max_response_len": 6}
    weight.grad = None
    full_loss = _actor_loss(weight, batch, mode)  # local counts of the whole mini-batch, T = 6
    full_loss.backward()
    full_grad = weight.grad.clone()
    assert full_grad.abs().sum() > 0.1  # the check below compares something
    loss, grad = _accumulate(weight, batch, mode, sizes, **denominators)
    torch.testing.assert_close(loss, full_loss.detach(), **F64)
    torch.testing.assert_close(grad, full_grad, **F64)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_local_denominators_break_the_invariance(mode):
    # The control: averaging micro-batch losses that use their own counts (or own padded length) is
    # NOT the mini-batch loss, which is why the worker must pass the global denominators.
    weight, batch = _toy_policy_batch()
    full_loss = _actor_loss(weight, batch, mode)
    loss, _ = _accumulate(weight, batch, mode, [1] * 8)
    assert abs(loss.item() / 8 - full_loss.item()) > 1e-3


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_value_loss_micro_batches_sum_to_the_mini_batch(mode):
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(8, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    old_values = values.detach() + 0.8 * torch.randn(8, 6, generator=generator, dtype=torch.float64)
    returns = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 2])
    mask = (torch.arange(6) < lengths.unsqueeze(-1)).to(torch.float64)
    full, _ = algos.value_loss(values, old_values, returns, mask, loss_agg_mode=mode)
    (full_grad,) = torch.autograd.grad(full, values)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part, _ = algos.value_loss(
            values[rows],
            old_values[rows],
            returns[rows],
            mask[rows],
            loss_agg_mode=mode,
            num_tokens=mask.sum(),
            num_seqs=8,
            max_response_len=6,
        )
        total = total + part
    (grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, full, **F64)
    torch.testing.assert_close(grad, full_grad, **F64)
