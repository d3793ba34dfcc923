"""The loop's own small pieces: advantage dispatch per estimator, DAPO's group filter, schedules,
and the settings each part is built with once (trainer/build.py)."""

import pytest
import torch

from trainer import algos
from trainer.batch import TrainBatch
from trainer.config import load_config
from trainer.data import PromptRecord
from trainer.loop import PromptGroup, compute_advantages, should
from trainer.rollout.base import Rollout
from trainer.build import advantage_settings, batch_plan, sampling_params


def rollout(prompt_index: int, loss_mask=(1, 1, 1)) -> Rollout:
    return Rollout(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        logprobs=[-1.0] * 3,
        loss_mask=list(loss_mask),
        finish_reason="stop",
        prompt_index=prompt_index,
    )


def batch_of(scores_per_group: list[list[float]]) -> tuple[TrainBatch, torch.Tensor]:
    rollouts, scores = [], []
    for prompt_index, group in enumerate(scores_per_group):
        for score in group:
            rollouts.append(rollout(prompt_index))
            scores.append(score)
    return TrainBatch.from_rollouts(rollouts, pad_id=0), torch.tensor(scores)


def settings_of(*overrides: str):
    return advantage_settings(load_config(list(overrides), check=False).algorithm)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_compute_advantages_uses_the_named_estimator(estimator):
    batch, scores = batch_of([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    settings = settings_of(f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=3")
    out, metrics = compute_advantages(batch, scores, settings, algos.FixedKLController(0.001))
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
    settings = settings_of(
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_ctrl.target_kl=0.1",
    )
    ctrl = algos.AdaptiveKLController(0.1, 0.1, 10000)
    out, metrics = compute_advantages(batch, scores, settings, ctrl)
    # k1 per token = -1 - (-1.5) = 0.5; the logged KL is the per-sequence token mean (verl): 0.5;
    # reward per token -0.1 * 0.5 = -0.05
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value > 0.1  # KL above target: the coefficient grows
    # returns with gamma = lam = 1 and zero values: the sum of the remaining token rewards
    assert out.returns[0].tolist() == pytest.approx([0.85, 0.9, 0.95])
    assert out.returns[1].tolist() == pytest.approx([-0.15, -0.1, -0.05])


def test_a_response_without_loss_tokens_keeps_its_score_in_the_group_statistics():
    # Group of 3 with scores 1, 0, 1; the last response has no loss token (all tool output, say).
    # Like verl, its own score 1 still counts: mean 2/3, unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = 0.57735
    # -> the first two get (1 - 2/3) / 0.57735 = 0.57735 and (0 - 2/3) / 0.57735 = -1.154701.
    # Counting it as a 0 instead would give mean 1/3 and +1.154701 / -0.57735 (the control).
    rollouts = [rollout(0), rollout(0), rollout(0, loss_mask=(0, 0, 0))]
    batch, scores = TrainBatch.from_rollouts(rollouts, pad_id=0), torch.tensor([1.0, 0.0, 1.0])
    out, _ = compute_advantages(batch, scores, settings_of("algorithm.adv_estimator=grpo"), None)
    assert out.advantages[:, 0].tolist() == pytest.approx([0.57735, -1.154701, 0.0], abs=1e-5)
    assert out.advantages[2].abs().sum() == 0 and out.token_scores[2].abs().sum() == 0
    # with the KL penalty in the reward: k1 = 0.5 on each of 3 loss tokens, coef 0.1 -> outcome - 0.15
    # for the first two; the third has no loss token, so no penalty: outcomes 0.85, -0.15, 1.0
    kl_batch = batch.with_fields(old_logprobs=torch.full((3, 3), -1.0), ref_logprobs=torch.full((3, 3), -1.5))
    settings = settings_of("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true")
    out, _ = compute_advantages(kl_batch, scores, settings, algos.FixedKLController(0.1))
    expected = algos.grpo_advantages(torch.tensor([0.85, -0.15, 1.0]), batch.group_ids, batch.response_mask)
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)


def test_dapo_keeps_a_group_only_when_its_rewards_vary():
    prompt = PromptRecord(uid="u", data_source="s", prompt_ids=[1], raw_prompt=[], ground_truth="7")
    group = PromptGroup(prompt, scores=[0.3] * 6, correct=[0.0] * 6)
    assert not group.rewards_vary("score") and not group.rewards_vary("acc")  # all equal: dropped
    group.scores[4] = 0.2
    assert group.rewards_vary("score") and not group.rewards_vary("acc")  # the metric decides
    group.correct[0] = 1.0
    assert group.rewards_vary("acc")
    assert PromptGroup(prompt, scores=[1.0], correct=[1.0]).rewards_vary("acc")  # a group of one stays (verl)


def test_batch_plan_fetches_gen_batch_size_prompts_per_round_only_with_dapo():
    base = ["data.train_batch_size=4", "data.gen_batch_size=12", "actor_rollout_ref.rollout.n=2"]
    plain = batch_plan(load_config(base, check=False))
    assert (plain.prompts, plain.prompts_per_round, plain.group_filter) == (4, 4, None)
    dapo = batch_plan(
        load_config(
            [*base, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3"],
            check=False,
        )
    )
    assert (dapo.prompts, dapo.prompts_per_round) == (4, 12)
    assert (dapo.group_filter.metric, dapo.group_filter.max_rounds) == ("acc", 3)


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


@pytest.mark.parametrize("kind", ["qwen", "char"])
def test_responses_decode_in_one_backend_call_as_batch_decode_would(kind):
    # the driver decodes every rollout of a step (trainer/rewards.py): in one call to the fast tokenizer's
    # backend, which must give batch_decode's text exactly, special tokens (the EOS) dropped
    from testing.tiny import load_tiny_tokenizer
    from trainer.rewards import decode_responses

    tokenizer = load_tiny_tokenizer(kind)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, len(tokenizer), (n,), generator=generator).tolist() for n in (1, 7, 40)]
    ids[1][-1] = tokenizer.eos_token_id
    ids.append(tokenizer("12 + 30 = 42. #### 42", add_special_tokens=False)["input_ids"])
    texts = decode_responses(tokenizer, ids)
    assert texts == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert texts[-1] == "12 + 30 = 42. #### 42"
    assert tokenizer.decode([tokenizer.eos_token_id]) not in texts[1]
