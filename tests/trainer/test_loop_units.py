"""The loop's own small pieces: advantage dispatch per estimator, DAPO's group filter, the groups
multi_turn.tool_failure=drop_group leaves out, schedules, and the settings each part is built with once
(trainer/build.py)."""

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.common.client import ServiceError
from services.reward_server.schemas import RewardOptions, RewardResult
from trainer import algos
from trainer.agent.loop import AgentBatch, ToolStats, Trajectory
from trainer.agent.search import SearchStats
from trainer.batch import TrainBatch
from trainer.build import BatchPlan, GroupFilter, advantage_settings, batch_plan, sampling_params
from trainer.config import load_config
from trainer.data import PromptBatch, PromptRecord
from trainer.collect import (
    PromptGroup,
    TrainingAborted,
    collect_batch,
    generate_groups,
    padded_batch,
    trainable_groups,
)
from trainer.loop import compute_advantages, no_signal_warning, should
from trainer.rollout.base import Rollout


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
    # the rollouts' int64 arrays (a Ray rank's, views into its message) decode to the same texts
    assert decode_responses(tokenizer, [np.asarray(row, dtype=np.int64) for row in ids]) == texts


# ------------------------------------------------------------------ multi_turn.tool_failure=drop_group


def prompt_record(uid: str) -> PromptRecord:
    return PromptRecord(uid=uid, data_source="s", prompt_ids=[1, 2], raw_prompt=[], ground_truth=uid)


def test_batch_plan_drops_failed_tool_groups_only_for_multi_turn_drop_group():
    on = ["actor_rollout_ref.rollout.multi_turn.enable=true"]
    drop = "actor_rollout_ref.rollout.multi_turn.tool_failure=drop_group"
    assert batch_plan(load_config([*on, drop], check=False)).drop_failed_tool_groups
    assert not batch_plan(load_config([drop], check=False)).drop_failed_tool_groups  # no agent loop
    assert not batch_plan(load_config(on, check=False)).drop_failed_tool_groups  # tool_failure=text


def tool_batch(groups: int, n: int, failed: set[int]) -> AgentBatch:
    """An agent batch of `groups` prompts x n trajectories in which the prompts `failed` had a tool fail."""
    trajectories = [
        Trajectory(index, [1, 2], tool_errors=int(index in failed))
        for index in range(groups)
        for _ in range(n)
    ]
    return AgentBatch(
        [], trajectories, 0.0, SearchStats(), {"search": ToolStats(errors=len(failed))}, len(failed)
    )


def test_trainable_groups_leave_out_failed_tool_groups_then_apply_dapo():
    groups = [PromptGroup(prompt_record(str(i)), scores=[0.0, float(i % 2)]) for i in range(4)]
    drop = BatchPlan(prompts=4, prompts_per_round=4, group_filter=None, drop_failed_tool_groups=True)
    tools = tool_batch(4, 2, failed={1, 2})
    assert [g.prompt.uid for g in trainable_groups(groups, drop, tools)] == ["0", "3"]
    # tool_failure text or retry: the failed calls are text the model trains on, nothing is dropped
    keep = dataclasses.replace(drop, drop_failed_tool_groups=False)
    assert [g.prompt.uid for g in trainable_groups(groups, keep, tools)] == ["0", "1", "2", "3"]
    # with DAPO as well: of the groups left, only those whose scores vary (odd i: 0 then 1)
    dapo = dataclasses.replace(drop, group_filter=GroupFilter(metric="score", max_rounds=0))
    assert [g.prompt.uid for g in trainable_groups(groups, dapo, tools)] == ["3"]
    assert trainable_groups(groups, drop, None) == groups  # single-turn: no agent batch


def test_a_round_whose_every_group_had_a_tool_fail_stops_as_a_service_error():
    groups = [PromptGroup(prompt_record(str(i))) for i in range(3)]
    plan = BatchPlan(prompts=3, prompts_per_round=3, group_filter=None, drop_failed_tool_groups=True)
    with pytest.raises(ServiceError, match=r"every one of the 3 prompt groups .*\(tools \['search'\]"):
        trainable_groups(groups, plan, tool_batch(3, 2, failed={0, 1, 2}))


def test_a_round_whose_every_tool_call_failed_stops_under_text_and_retry_too():
    # tool_failure text / retry train on the failures' text; when every call failed (the clients'
    # retries spent: the services are down) that is all they would train on, so the run stops as it
    # does when a service stays down. One call that ran is enough to go on.
    groups = [PromptGroup(prompt_record(str(i))) for i in range(3)]
    plan = BatchPlan(prompts=3, prompts_per_round=3, group_filter=None, drop_failed_tool_groups=False)

    def batch(calls: int, invalid: int, errors: int) -> AgentBatch:
        stats = {"search": ToolStats(calls=calls, invalid_calls=invalid, errors=errors)}
        return AgentBatch([], [], 0.0, SearchStats(), stats)

    with pytest.raises(ServiceError, match=r"every one of the 5 tool calls .*\(tools \['search'\]\)"):
        trainable_groups(groups, plan, batch(calls=6, invalid=1, errors=5))
    assert trainable_groups(groups, plan, batch(calls=6, invalid=1, errors=4)) == groups
    assert trainable_groups(groups, plan, batch(calls=2, invalid=2, errors=0)) == groups  # none ran
    assert trainable_groups(groups, plan, batch(calls=0, invalid=0, errors=0)) == groups  # no calls


class DroppingAgent:
    """The agent loop's drop_group contract without a model: round r fails a tool call in the prompts
    rounds[r] (every trajectory of them) and, as AgentLoop does, hands only the other groups on."""

    def __init__(self, rounds: list[set[int]]) -> None:
        self.rounds = rounds

    async def generate(self, prompt_ids, sampling, on_group=None) -> AgentBatch:
        failed = self.rounds.pop(0)
        batch = tool_batch(len(prompt_ids), sampling.n, failed)
        for index in range(len(prompt_ids)):
            if index not in failed:
                await on_group(index, [rollout(index) for _ in range(sampling.n)])
        return batch


class ListSource:
    """Prompts "0", "1", ... in order, as the data source hands them out."""

    epoch = 0

    def __init__(self) -> None:
        self.taken = 0

    async def next_batch(self, batch_size: int) -> PromptBatch:
        uids = range(self.taken, self.taken + batch_size)
        self.taken += batch_size
        return PromptBatch([prompt_record(str(uid)) for uid in uids], cursor=None, epoch=0)


class CountingScorer:
    def __init__(self) -> None:
        self.scored: list[str] = []  # the prompt (its ground truth is its uid) of every item scored

    async def score(self, items, options=None) -> list[RewardResult]:
        self.scored += [item["ground_truth"] for item in items]
        return [RewardResult(score=1.0, correct=True) for _ in items]


def fake_run(rounds: list[set[int]], *overrides: str) -> SimpleNamespace:
    from testing.tiny import load_tiny_tokenizer

    cfg = load_config(
        [
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.tool_failure=drop_group",
            *overrides,
        ],
        check=False,
    )
    return SimpleNamespace(
        cfg=cfg,
        plan=batch_plan(cfg),
        sampling=sampling_params(cfg.actor_rollout_ref.rollout, 8, validation=False),
        source=ListSource(),
        agent=DroppingAgent(rounds),
        scorer=CountingScorer(),
        tokenizer=load_tiny_tokenizer("char"),
        reward_options=RewardOptions(),
        pad_id=0,
        colocated=False,
    )


def test_drop_group_refills_the_batch_with_another_round_and_never_scores_a_dropped_group():
    # round 1: prompts 0 and 1, prompt 1's tool failed; round 2: prompts 2 and 3, all well (3 is not needed)
    run = fake_run([{1}, set()])
    collected = asyncio.run(collect_batch(run, 1, {}))
    assert [g.prompt.uid for g in collected.groups] == ["0", "2"]
    assert collected.batch.input_ids.shape[0] == 4  # 2 prompts x n=2, prompt 1 nowhere
    assert collected.metrics["train/num_gen_batches"] == 2 and collected.metrics["tool/dropped_groups"] == 1
    assert run.scorer.scored.count("1") == 0  # prompts 0, 2, 3 scored as they ended; prompt 1 never was
    assert sorted(run.scorer.scored) == ["0", "0", "2", "2", "3", "3"]


def test_drop_group_with_dapo_counts_the_dropped_groups_in_its_max_rounds_message():
    run = fake_run(
        [{1}, {0}],
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=2",
    )
    # every score is 1.0, so DAPO keeps nothing either; the message says what the tools dropped
    with pytest.raises(
        TrainingAborted, match="in 2 generation rounds .*; 2 groups were dropped for a failed"
    ):
        asyncio.run(collect_batch(run, 1, {}))


def test_a_step_whose_every_group_had_a_tool_fail_stops_with_a_service_error():
    run = fake_run([{0, 1}])
    with pytest.raises(ServiceError, match="every one of the 2 prompt groups"):
        asyncio.run(collect_batch(run, 1, {}))
    assert run.scorer.scored == []


def test_a_custom_reward_function_gets_dapos_overlong_penalty_as_in_verl(tmp_path):
    from trainer.rewards import CustomFunctionScorer, reward_options

    (tmp_path / "score.py").write_text("def score(source, response, truth, extra):\n    return 1.0\n")
    config = load_config(
        [
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=1.0",
            "data.max_response_length=16",
        ]
    )
    options = reward_options(config.reward_model, 16)
    scorer = CustomFunctionScorer(str(tmp_path / "score.py"), "score")
    items = [
        {"data_source": "x", "response": "r", "ground_truth": "1", "extra_info": {"response_length": n}}
        for n in (12, 14, 16)
    ]
    shaped = asyncio.run(scorer.score(items, options))
    assert [r.score for r in shaped] == [1.0, 0.5, 0.0]  # 0 up to 16 - 4 tokens, then linear to -1
    assert [r.score for r in asyncio.run(scorer.score(items))] == [1.0, 1.0, 1.0]


def test_a_step_whose_groups_all_scored_alike_says_it_learned_nothing():
    """GRPO over groups that each scored alike: every advantage is 0 and the update gets no signal from
    the rewards (a reward that cannot vary looks like this on every step). One group that varies is enough
    to stay quiet."""
    settings = settings_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=3")
    batch, scores = batch_of([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out, _ = compute_advantages(batch, scores, settings, algos.FixedKLController(0.001))
    warning = no_signal_warning(out.advantages, scores, step=7)
    assert warning is not None and warning.startswith("step 7: every advantage is 0")
    assert "mean score 0.5" in warning

    batch, scores = batch_of([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    out, _ = compute_advantages(batch, scores, settings, algos.FixedKLController(0.001))
    assert no_signal_warning(out.advantages, scores, step=7) is None


class ReversedAgent:
    """Every group back, the last prompt's first, each prompt's responses its own (index + 10, longer
    for later prompts): what a padded batch must put in prompt order."""

    async def generate(self, prompt_ids, sampling, on_group=None) -> AgentBatch:
        for index in reversed(range(len(prompt_ids))):
            response = [index + 10] * (index + 1)
            rollouts = [
                dataclasses.replace(
                    rollout(index),
                    response_ids=response,
                    logprobs=[-0.5] * len(response),
                    loss_mask=[1] * len(response),
                )
                for _ in range(sampling.n)
            ]
            await on_group(index, rollouts)
        return tool_batch(len(prompt_ids), sampling.n, set())


class SlowScorer(CountingScorer):
    async def score(self, items, options=None) -> list[RewardResult]:
        await asyncio.sleep(0.05)  # a reward-server's round trip: the batch is padded meanwhile
        return await super().score(items, options)


def test_a_round_kept_whole_is_padded_while_it_is_scored_into_the_same_batch():
    run = fake_run([], "data.train_batch_size=3", "actor_rollout_ref.rollout.multi_turn.tool_failure=text")
    run.agent, run.scorer = ReversedAgent(), SlowScorer()
    assert not run.plan.drop_failed_tool_groups and run.plan.group_filter is None
    prompts = [prompt_record(str(uid)) for uid in range(3)]

    async def one_round():
        groups, _, padded = await generate_groups(run, prompts, run.sampling, {}, pad=True)
        assert padded is not None  # started beside the scoring
        return groups, await padded

    groups, early = asyncio.run(one_round())
    late = padded_batch(0, [(g.prompt, g.rollouts) for g in groups])  # from the scored groups, in order
    for field in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "group_ids"):
        assert torch.equal(getattr(early, field), getattr(late, field)), field
    assert early.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert early.responses[:, 0].tolist() == [10, 10, 11, 11, 12, 12]

    collected = asyncio.run(collect_batch(run, 1, {}))  # the step's path takes that batch
    assert [g.prompt.uid for g in collected.groups] == ["0", "1", "2"]
    assert torch.equal(
        collected.batch.input_ids,
        padded_batch(0, [(g.prompt, g.rollouts) for g in collected.groups]).input_ids,
    )
    assert collected.batch.responses[:, 0].tolist() == [10, 10, 11, 11, 12, 12]
