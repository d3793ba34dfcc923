"""The loop's own small pieces: advantage dispatch per estimator, schedules, sampling settings."""

import pytest
import torch

from trainer import algos
from trainer.batch import TrainBatch
from trainer.config import load_config
from trainer.loop import compute_advantages, sampling_params, should
from trainer.rollout.base import Rollout


def batch_of(scores_per_group: list[list[float]]) -> tuple[TrainBatch, torch.Tensor]:
    rollouts, scores = [], []
    for prompt_index, group in enumerate(scores_per_group):
        for score in group:
            rollouts.append(
                Rollout(
                    prompt_ids=[1, 2],
                    response_ids=[3, 4, 5],
                    logprobs=[-1.0] * 3,
                    loss_mask=[1] * 3,
                    finish_reason="stop",
                    prompt_index=prompt_index,
                )
            )
            scores.append(score)
    return TrainBatch.from_rollouts(rollouts, pad_id=0), torch.tensor(scores)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_compute_advantages_uses_the_named_estimator(estimator):
    batch, scores = batch_of([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    algo = load_config(
        [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=3"], check=False
    ).algorithm
    out, metrics = compute_advantages(batch, scores, algo, algos.FixedKLController(0.001))
    mask = batch.response_mask
    expected = {
        "grpo": lambda: algos.grpo_advantages(scores, batch.group_ids, mask),
        "rloo": lambda: algos.rloo_advantages(scores, batch.group_ids, mask),
        "reinforce_plus_plus": lambda: algos.reinforce_plus_plus_advantages(
            algos.scores_to_token_rewards(scores, mask), mask, gamma=1.0
        ),
        "reinforce_plus_plus_baseline": lambda: algos.reinforce_plus_plus_baseline_advantages(
            scores, batch.group_ids, mask
        ),
    }[estimator]()
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)
    assert torch.equal(out.returns, out.advantages) and metrics == {}
    # the score lands on each response's last token
    assert out.token_scores[:, -1].tolist() == scores.tolist() and out.token_scores[:, :-1].abs().sum() == 0


def test_compute_advantages_gae_with_kl_in_reward_updates_the_controller():
    batch, scores = batch_of([[1.0, 0.0]])
    batch = batch.with_fields(
        values=torch.zeros_like(batch.response_mask),
        old_logprobs=torch.full_like(batch.response_mask, -1.0),
        ref_logprobs=torch.full_like(batch.response_mask, -1.5),
    )
    algo = load_config(
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=kl",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.1",
            "algorithm.kl_ctrl.target_kl=0.1",
        ],
        check=False,
    ).algorithm
    ctrl = algos.AdaptiveKLController(0.1, 0.1, 10000)
    out, metrics = compute_advantages(batch, scores, algo, ctrl)
    # k1 per token = -1 - (-1.5) = 0.5; the logged KL is the per-sequence token mean (verl): 0.5;
    # reward per token -0.1 * 0.5 = -0.05
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value > 0.1  # KL above target: the coefficient grows
    # returns with gamma = lam = 1 and zero values: the sum of the remaining token rewards
    assert out.returns[0].tolist() == pytest.approx([0.85, 0.9, 0.95])
    assert out.returns[1].tolist() == pytest.approx([-0.15, -0.1, -0.05])


def test_should_fires_every_freq_steps_and_at_the_end():
    assert [s for s in range(1, 11) if should(4, s, 10)] == [4, 8, 10]
    assert not any(should(0, s, 10) or should(-1, s, 10) for s in range(1, 11))


def test_sampling_params_follow_rollout_and_val_kwargs():
    rollout = load_config(
        [
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.top_k=20",
        ],
        check=False,
    ).actor_rollout_ref.rollout
    train = sampling_params(rollout, 64, validation=False)
    assert (train.temperature, train.n, train.top_k, train.max_new_tokens) == (0.7, 4, 20, 64)
    val = sampling_params(rollout, 64, validation=True)
    assert (val.temperature, val.n) == (0.0, 1)  # verl's default val_kwargs: greedy, one sample
