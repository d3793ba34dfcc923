"""Policy / Reference / Critic on a tiny random Qwen2 (fp32, CPU): chunked logprobs, the PPO update's
micro-batch invariance, learning direction, LR schedule, clipping, checkpoints of worker state."""

import copy
import math

import pytest
import torch

from trainer.batch import TrainBatch
from trainer.model import load_critic, load_policy, load_reference
from trainer.rollout.base import Rollout
from testing.tiny import make_tiny_model
from trainer.workers.policy import Policy, PolicyLossSettings, is_on_policy
from trainer.workers.common import (
    OptimizerSettings,
    TokenBudget,
    budget_units,
    UpdateSettings,
    clip_and_step,
    even_bounds,
    lr_multiplier,
    micro_batches,
    token_budget_bounds,
)
from trainer.workers.critic import Critic, ValueLossSettings
from trainer.workers.logprobs import LogprobHead, response_logprobs
from trainer.workers.reference import Reference

VOCAB = 100  # the char tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=3
    )


@pytest.fixture(scope="module")
def base_model(model_dir):
    return load_policy(str(model_dir))


def fresh(base_model):
    return copy.deepcopy(base_model)


def optim(lr=1e-3, grad_clip=1.0, **overrides):
    settings = {
        "lr": lr,
        "weight_decay": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "grad_clip": grad_clip,
        "warmup_steps": 0,
        "total_steps": 10,
        "schedule": "constant",
        "min_lr_ratio": 0.0,
    }
    return OptimizerSettings(**{**settings, **overrides})


def loss_settings(**overrides):
    settings = {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.0,
        "kl_loss_type": "low_var_kl",
    }
    return PolicyLossSettings(**{**settings, **overrides})


def sizes(mini=8, micro=8, epochs=1):
    return UpdateSettings(mini_batch_size=mini, micro_batch_size=micro, ppo_epochs=epochs)


def policy_of(model, *, mini=8, micro=8, epochs=1, loss=None, logprob_micro=None, **optim_overrides):
    """A Policy built once with its settings, as trainer/build.py builds it."""
    return Policy(
        model,
        optim(**optim_overrides),
        sizes(mini, micro, epochs),
        loss or loss_settings(),
        log_prob_micro_batch_size=logprob_micro,
    )


def critic_of(model, *, mini=8, micro=8, loss=None, forward_micro=None, **optim_overrides):
    loss = loss or ValueLossSettings(cliprange_value=0.5, loss_agg_mode="token-mean")
    return Critic(
        model, optim(**optim_overrides), sizes(mini, micro), loss, forward_micro_batch_size=forward_micro
    )


def make_batch(batch_size=8, seed=0, max_prompt=7, max_response=9) -> TrainBatch:
    """Random prompts/responses of varying lengths (so micro-batches have different padding), 2 per group."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(batch_size):
        p = int(torch.randint(2, max_prompt + 1, (1,), generator=gen))
        t = int(torch.randint(1, max_response + 1, (1,), generator=gen))
        loss_mask = [1] * t
        if t > 3:
            loss_mask[1] = 0  # a masked (tool-output-like) token inside the response
        rollouts.append(
            Rollout(
                prompt_ids=torch.randint(3, VOCAB, (p,), generator=gen).tolist(),
                response_ids=torch.randint(3, VOCAB, (t,), generator=gen).tolist(),
                logprobs=[0.0] * t,
                loss_mask=loss_mask,
                finish_reason="length",
                prompt_index=i // 2,
            )
        )
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


def with_training_fields(batch: TrainBatch, model, seed=1) -> TrainBatch:
    """old/ref logprobs off-policy by a little (so ratios and clipping are exercised) and +-advantages."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        current = response_logprobs(model, batch).logprobs
    noise = 0.3 * torch.randn(current.shape, generator=gen)
    advantages = torch.randn(len(batch), 1, generator=gen).expand_as(current) * batch.response_mask
    return batch.with_fields(
        old_logprobs=(current + noise) * batch.response_mask,
        ref_logprobs=(current - noise) * batch.response_mask,
        advantages=advantages,
    )


def without_signal(batch: TrainBatch, rows) -> TrainBatch:
    """`rows` with all-zero advantages, as GRPO gives a group whose rewards are all equal."""
    advantages = batch.advantages.clone()
    advantages[list(rows)] = 0.0
    return batch.with_fields(advantages=advantages)


def update_counting_tokens(policy: Policy, batch: TrainBatch) -> tuple[dict, torch.Tensor, int]:
    """(metrics, the parameters after, the token positions the update's forwards embedded)."""
    embedded = []
    hook = policy.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, _out: embedded.append(args[0].numel())
    )
    try:
        metrics = policy.update(batch)
    finally:
        hook.remove()
    return metrics, flat_params(policy.model), sum(embedded)


@pytest.mark.parametrize(
    "mini, micro, rows",
    [(8, 8, (0, 1, 4, 5)), (4, 2, (0, 1, 4, 5)), (4, 1, (0, 1, 2, 3)), (8, 3, range(8))],
)
def test_skipping_zero_advantage_rows_gives_the_same_update_from_fewer_rows(base_model, mini, micro, rows):
    """A loss of the policy term alone: rows whose advantages are all 0 add exactly 0 to the gradient, so
    the update without them is the update with them (the loss keeps the whole mini-batch's denominators).
    A mini-batch with no signal at all (rows 0-3 in the third case, every row in the last) trains one row:
    AdamW still steps every parameter (weight decay, moments) as the full update does."""
    batch = without_signal(with_training_fields(make_batch(seed=4), base_model), rows)
    results = []
    for skip in (False, True):
        policy = policy_of(
            fresh(base_model), mini=mini, micro=micro, loss=loss_settings(skip_zero_advantage_rows=skip)
        )
        results.append(update_counting_tokens(policy, batch))
    (full, full_params, full_tokens), (skipped, skipped_params, skipped_tokens) = results
    assert skipped_tokens < full_tokens
    # as the micro-batch invariance test: fp32 summation order differs, AdamW magnifies it on near-zero
    # gradient entries; a missing row or a wrong denominator is off by O(10%)
    start = flat_params(base_model)
    delta_full, delta_skipped = full_params - start, skipped_params - start
    assert delta_full.norm() > 1e-5  # weight decay alone, where no row has signal
    assert (delta_skipped - delta_full).norm() / delta_full.norm() < 1e-4
    for name in ("actor/pg_loss", "actor/grad_norm"):
        assert skipped[name] == pytest.approx(full[name], rel=1e-5, abs=1e-7), name


def test_rows_are_skipped_only_when_the_loss_is_the_policy_term_alone():
    assert loss_settings(skip_zero_advantage_rows=True).skips_zero_advantage_rows
    assert not loss_settings(skip_zero_advantage_rows=True, use_kl_loss=True).skips_zero_advantage_rows
    assert not loss_settings(skip_zero_advantage_rows=True, entropy_coeff=0.01).skips_zero_advantage_rows
    assert not loss_settings().skips_zero_advantage_rows


def naive_logprobs(model, batch, temperature):
    logits = (
        model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits.float()
        / temperature
    )
    start = batch.prompt_width - 1
    logits = logits[:, start : start + batch.response_width]
    log_probs = torch.log_softmax(logits, dim=-1)
    logprobs = log_probs.gather(-1, batch.responses[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    real = batch.attention_mask[:, batch.prompt_width :]
    return logprobs * real, entropy * real


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ------------------------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_naive_full_vocab_computation(base_model, temperature):
    batch = make_batch()
    with torch.no_grad():
        chunked = response_logprobs(
            base_model, batch, temperature=temperature, with_entropy=True, head=LogprobHead(chunk_size=5)
        )
        logprobs, entropy = naive_logprobs(base_model, batch, temperature)
    assert chunked.logprobs.shape == (8, batch.response_width)
    torch.testing.assert_close(chunked.logprobs, logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.entropy, entropy, rtol=0, atol=1e-5)
    # padding is 0, real tokens are real log-probabilities of a ~uniform 100-way random model
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    assert (chunked.logprobs[~real] == 0).all() and (chunked.logprobs[real] < 0).all()
    assert chunked.entropy[real].mean() > 0.9 * math.log(VOCAB) * (1 if temperature == 1.0 else 0.95)


def test_chunked_gradients_through_checkpointed_chunks_equal_naive(base_model):
    batch = make_batch(batch_size=4)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5))
    grads = []
    for compute in ("chunked", "naive"):
        model = fresh(base_model)
        if compute == "chunked":
            out = response_logprobs(model, batch, with_entropy=True, head=LogprobHead(chunk_size=3))
            logprobs, entropy = out.logprobs, out.entropy
        else:
            logprobs, entropy = naive_logprobs(model, batch, 1.0)
        ((logprobs * weights).sum() + 0.1 * (entropy * weights).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_compute_logprobs_is_the_same_for_any_micro_batch_size_and_reference_matches_at_start(base_model):
    batch = make_batch()
    whole = policy_of(fresh(base_model), logprob_micro=8).compute_logprobs(batch, with_entropy=True)
    for micro in (1, 3):  # trimmed micro-batches of different padding
        split = policy_of(fresh(base_model), logprob_micro=micro).compute_logprobs(batch, with_entropy=True)
        torch.testing.assert_close(split.logprobs, whole.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(split.entropy, whole.entropy, rtol=0, atol=1e-5)
    reference = Reference(load_reference_from(base_model), micro_batch_size=4)
    torch.testing.assert_close(reference.compute_logprobs(batch), whole.logprobs, rtol=0, atol=1e-5)
    assert not any(p.requires_grad for p in reference.model.parameters())


def load_reference_from(base_model):
    model = fresh(base_model)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------- invariance


@pytest.mark.parametrize(
    "loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batch_1_x_8_gives_the_same_update_as_8_x_1(base_model, loss_agg_mode):
    batch = with_training_fields(make_batch(), base_model)
    loss = loss_settings(loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    results = {}
    for micro in (1, 8):
        policy = policy_of(fresh(base_model), mini=8, micro=micro, loss=loss, lr=1e-3)
        metrics = policy.update(batch)
        results[micro] = (flat_params(policy.model), metrics)
    start = flat_params(base_model)
    delta_1, delta_8 = results[1][0] - start, results[8][0] - start
    assert delta_8.norm() > 1e-3  # the update did move the parameters
    # fp32 summation order differs (gradients agree to ~3e-7 relative); AdamW's g / sqrt(v) magnifies that
    # on near-zero gradient entries, hence 1e-4 on the step. A wrong denominator is off by O(10%).
    assert (delta_1 - delta_8).norm() / delta_8.norm() < 1e-4
    assert (results[1][0] - results[8][0]).norm() / results[8][0].norm() < 1e-6
    for name, value in results[8][1].items():
        assert results[1][1][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert 0 < results[8][1]["actor/pg_clipfrac"] < 1  # the clip was active on some tokens


def grouped_batch(groups=4, n=2, seed=0) -> TrainBatch:
    """GRPO's layout: n samples of each prompt, responses of their own lengths."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for group in range(groups):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen)
        for _ in range(n):
            t = int(torch.randint(1, 10, (1,), generator=gen))
            response = torch.randint(3, VOCAB, (t,), generator=gen).tolist()
            rollouts.append(Rollout(prompt.tolist(), response, [0.0] * t, [1] * t, "length", group))
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


@pytest.mark.parametrize("micro", [8, 3])  # 3: a group split over two micro-batches shares within each
def test_shared_prompts_give_the_update_of_unshared_packed_forwards_from_fewer_tokens(base_model, micro):
    from trainer.packing import use_packed_attention

    batch = with_training_fields(grouped_batch(), base_model)
    loss = loss_settings(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    results = {}
    for share in (False, True):
        model = fresh(base_model)
        use_packed_attention(model, share_prompts=share)
        results[share] = update_counting_tokens(policy_of(model, mini=8, micro=micro, loss=loss), batch)
    (unshared, before, tokens), (shared, after, fewer) = results[False], results[True]
    assert (after - before).norm() / (before - flat_params(base_model)).norm() < 1e-4
    for name, value in unshared.items():
        assert shared[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    prompts = int(batch.prompt_lengths.sum())
    assert fewer < tokens and tokens - fewer <= prompts // 2  # at most one of each pair's prompts saved


def test_token_budget_cuts_consecutive_rows_within_the_budget():
    assert token_budget_bounds([4, 4, 4, 9, 2, 20, 1], 10) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert token_budget_bounds([], 10) == []
    # the same rows in exactly k parts (other ranks needed k): non-empty, near-even token sums
    assert even_bounds([4, 4, 4, 9, 2, 20, 1], 2) == [(0, 5), (5, 7)]
    assert even_bounds([5, 5, 5, 5], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert even_bounds([1, 1, 30], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="non-empty"):
        even_bounds([1, 2], 3)
    batch = make_batch()
    tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
    micros = list(micro_batches(batch, TokenBudget(max(tokens) + 1), torch.device("cpu")))
    assert sum(len(m) for m in micros) == len(batch) and 1 < len(micros) < len(batch)
    for micro in micros:
        assert (
            len(micro) == 1 or int((micro.prompt_lengths + micro.response_lengths).sum()) <= max(tokens) + 1
        )


def test_a_token_budget_cuts_between_prompt_groups_where_the_model_shares_prompts(base_model):
    """With shared prompts a budget counts a group's prompt once (as the layers run it) and cuts between
    groups, so no prompt runs twice; a group over the budget alone is cut by rows. The update is the
    unshared one's, and the embedded tokens drop by every fitting group's repeated prompts."""
    from trainer.packing import use_packed_attention

    batch = with_training_fields(grouped_batch(groups=6, n=3, seed=5), base_model)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    prompts, groups = batch.prompt_lengths.tolist(), batch.group_ids.tolist()
    repeat = [row > 0 and groups[row - 1] == groups[row] for row in range(len(groups))]
    cost = {g: 0 for g in groups}
    for row, g in enumerate(groups):
        cost[g] += lengths[row] - prompts[row] * repeat[row]
    budget = max(cost.values()) - 1
    too_big = {g for g, c in cost.items() if c > budget}
    firsts, costs = budget_units(batch, budget, shared_prompts=True)
    assert firsts == [r for r, g in enumerate(groups) if g in too_big or not repeat[r]]
    assert costs == [lengths[r] if groups[r] in too_big else cost[groups[r]] for r in firsts]

    def cut(shared: bool) -> list[list[int]]:
        micros = micro_batches(batch, TokenBudget(budget), torch.device("cpu"), shared_prompts=shared)
        return [m.group_ids.tolist() for m in micros]

    def split_groups(parts: list[list[int]]) -> set[int]:
        return {g for ids in parts for g in ids if ids.count(g) != groups.count(g)}

    assert sum(map(len, cut(True))) == len(batch) and split_groups(cut(True)) <= too_big
    assert split_groups(cut(False)) - too_big  # counted row by row, a fitting group was cut

    loss = loss_settings(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    update = UpdateSettings(
        mini_batch_size=len(batch), micro_batch_size=len(batch), token_budget=TokenBudget(budget)
    )
    results = {}
    for share in (False, True):
        model = fresh(base_model)
        use_packed_attention(model, share_prompts=share)
        policy = Policy(model, optim(lr=1e-3), update, loss, log_prob_micro_batch_size=TokenBudget(budget))
        results[share] = update_counting_tokens(policy, batch)
    (unshared, before, tokens), (shared, after, fewer) = results[False], results[True]
    assert (after - before).norm() / (before - flat_params(base_model)).norm() < 1e-4
    for name, value in unshared.items():
        assert shared[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    saved = sum(prompts[r] for r, g in enumerate(groups) if repeat[r] and g not in too_big)
    assert tokens == sum(lengths) and fewer <= tokens - saved


def test_token_budget_micro_batches_give_the_update_and_logprobs_of_sequence_counts(base_model):
    # verl's use_dynamic_bsz: micro-batches cut by tokens train the same parameters (the loss divides
    # by the mini-batch's global counts, whatever the cut) and give the same logprobs
    batch = with_training_fields(make_batch(), base_model)
    loss = loss_settings(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    results = {}
    for name, update, logprob_micro in (
        ("count", sizes(8, 8), 8),
        ("tokens", UpdateSettings(mini_batch_size=8, micro_batch_size=8, token_budget=TokenBudget(20)), None),
    ):
        policy = Policy(
            fresh(base_model), optim(lr=1e-3), update, loss, log_prob_micro_batch_size=logprob_micro
        )
        logprobs = policy.compute_logprobs(batch).logprobs
        results[name] = (logprobs, policy.update(batch), flat_params(policy.model))
    (lp_t, metrics_t, params_t), (lp_c, metrics_c, params_c) = results["tokens"], results["count"]
    torch.testing.assert_close(lp_t, lp_c, rtol=0, atol=1e-5)
    start = flat_params(base_model)
    assert (params_t - params_c).norm() / (params_c - start).norm() < 1e-4
    assert metrics_t["actor/pg_loss"] == pytest.approx(metrics_c["actor/pg_loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_response_without_loss_tokens_weighs_nothing_in_the_seq_mean(base_model, loss_agg_mode):
    # Row 3 loses every loss token (all tool output, say). Like verl, the seq-mean counts only rows with
    # loss tokens, so the update equals the update without that row: the same pg_loss and parameters.
    # Counting it would scale pg_loss by 7/8 (the control below).
    batch = with_training_fields(make_batch(), base_model)
    mask = batch.response_mask.clone()
    mask[3] = 0
    masked = batch.with_fields(response_mask=mask, advantages=batch.advantages * mask)
    without = batch.select([row for row in range(8) if row != 3])
    loss = loss_settings(loss_agg_mode=loss_agg_mode, use_kl_loss=True, kl_loss_coef=0.1)
    results = {}
    for name, rows, mini in (("masked", masked, 8), ("without", without, 7)):
        policy = policy_of(fresh(base_model), mini=mini, micro=3, loss=loss)
        results[name] = (policy.update(rows), flat_params(policy.model))
    (metrics, params), (expected, expected_params) = results["masked"], results["without"]
    for name in ("actor/pg_loss", "actor/kl_loss"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5), name
    assert abs(7 / 8 * expected["actor/pg_loss"] - metrics["actor/pg_loss"]) > 1e-4
    start = flat_params(base_model)
    assert (params - expected_params).norm() / (expected_params - start).norm() < 1e-4


def test_on_policy_update_without_old_logprobs_equals_update_with_them(base_model):
    batch = with_training_fields(make_batch(), base_model)
    assert is_on_policy(8, mini_batch_size=8, ppo_epochs=1)
    assert not is_on_policy(8, mini_batch_size=4, ppo_epochs=1) and not is_on_policy(8, 8, ppo_epochs=2)
    explicit = policy_of(fresh(base_model), mini=8, micro=4, logprob_micro=8)
    old = explicit.compute_logprobs(batch).logprobs
    metrics = explicit.update(batch.with_fields(old_logprobs=old))
    skipped = policy_of(fresh(base_model), mini=8, micro=4)
    assert skipped.is_on_policy(8) and not skipped.is_on_policy(9)
    metrics_skipped = skipped.update(batch.with_fields(old_logprobs=None))
    torch.testing.assert_close(flat_params(skipped.model), flat_params(explicit.model), rtol=0, atol=1e-6)
    assert metrics_skipped["actor/ppo_kl"] == 0 and metrics_skipped["actor/pg_clipfrac"] == 0
    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    with pytest.raises(ValueError, match="on-policy"):
        policy_of(fresh(base_model), mini=4, micro=4).update(batch.with_fields(old_logprobs=None))


def test_gradient_checkpointing_gives_the_same_update(model_dir, base_model):
    batch = with_training_fields(make_batch(), base_model)
    params = []
    for checkpointing in (False, True):
        policy = policy_of(load_policy(str(model_dir), gradient_checkpointing=checkpointing), mini=4, micro=2)
        policy.update(batch)
        params.append(flat_params(policy.model))
    assert any(getattr(module, "gradient_checkpointing", False) is True for module in policy.model.modules())
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------- learning


def test_ppo_update_raises_positive_advantage_tokens_and_lowers_negative_ones(base_model):
    batch = make_batch(seed=4)
    advantages = torch.tensor([1.0, -1.0] * 4)[:, None] * batch.response_mask
    batch = batch.with_fields(advantages=advantages)
    policy = policy_of(fresh(base_model), mini=4, micro=2, logprob_micro=8, lr=3e-3)
    before = policy.compute_logprobs(batch).logprobs
    batch = batch.with_fields(old_logprobs=before)
    losses = []
    for _ in range(3):  # 3 updates x 2 mini-batches = 6 optimizer steps on the same rollouts
        metrics = policy.update(batch)
        losses.append(metrics["actor/pg_loss"])
    after = policy.compute_logprobs(batch).logprobs
    change = ((after - before) * batch.response_mask).sum(-1) / batch.response_mask.sum(-1)
    assert (change[0::2] > 0.05).all(), change  # positive advantage: more likely
    assert (change[1::2] < -0.05).all(), change  # negative advantage: less likely
    assert losses[-1] < losses[0] - 0.05, losses
    assert metrics["actor/pg_clipfrac"] > 0  # by then the ratio left the trust region on some tokens
    assert set(metrics) >= {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
    }


def test_kl_loss_pulls_the_policy_back_toward_the_reference(base_model):
    batch = make_batch(seed=6)
    loss = loss_settings(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1")
    policy = policy_of(fresh(base_model), loss=loss, lr=3e-3)
    ref_logprobs = policy.compute_logprobs(batch).logprobs
    shifted = ref_logprobs - 0.5 * batch.response_mask  # a reference that found these tokens less likely
    batch = batch.with_fields(advantages=torch.zeros_like(ref_logprobs), ref_logprobs=shifted)
    first = policy.update(batch)
    # k1 = logprob - ref = 0.5 on every token: token-mean 0.5 exactly
    assert first["actor/kl_loss"] == pytest.approx(0.5, abs=1e-5)
    for _ in range(4):
        last = policy.update(batch)
    assert last["actor/kl_loss"] < 0.5 - 0.05


def test_critic_update_reduces_value_loss(model_dir):
    critic = critic_of(load_critic(str(model_dir)), mini=4, micro=2, forward_micro=3, lr=3e-3)
    batch = make_batch()
    values = critic.compute_values(batch)
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    assert values.shape == batch.response_mask.shape and (values[~real] == 0).all()
    whole = critic_of(critic.model, forward_micro=8).compute_values(batch)
    torch.testing.assert_close(values, whole, rtol=0, atol=1e-5)
    returns = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask  # a per-sequence target
    history = []
    for _ in range(8):
        batch = batch.with_fields(values=critic.compute_values(batch), returns=returns)
        history.append(critic.update(batch))
    assert history[-1]["critic/vf_loss"] < 0.5 * history[0]["critic/vf_loss"], [
        h["critic/vf_loss"] for h in history
    ]
    assert set(history[0]) >= {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
    }


def test_critic_micro_batch_invariance(model_dir):
    base = load_critic(str(model_dir))
    batch = make_batch()
    values = critic_of(fresh(base)).compute_values(batch)
    batch = batch.with_fields(values=values, returns=values + torch.randn(values.shape) * batch.response_mask)
    loss = ValueLossSettings(cliprange_value=0.2, loss_agg_mode="seq-mean-token-mean")
    params = []
    for micro in (1, 8):
        critic = critic_of(fresh(base), mini=8, micro=micro, loss=loss)
        critic.update(batch)
        params.append(flat_params(critic.model))
    start = flat_params(base)
    assert (params[0] - params[1]).norm() / (params[1] - start).norm() < 1e-4
    assert (params[0] - params[1]).norm() / params[1].norm() < 1e-6


# ------------------------------------------------------------------------ optimizer and state


def test_lr_schedule_hand_values():
    constant = {"warmup_steps": 4, "total_steps": 10, "schedule": "constant", "min_lr_ratio": 0.0}
    assert [lr_multiplier(s, **constant) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = {"warmup_steps": 0, "total_steps": 10, "schedule": "cosine", "min_lr_ratio": 0.1}
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * s / 10))
    assert lr_multiplier(0, **cosine) == pytest.approx(1.0)
    assert lr_multiplier(5, **cosine) == pytest.approx(0.55)
    assert lr_multiplier(10, **cosine) == pytest.approx(0.1)
    assert lr_multiplier(15, **cosine) == pytest.approx(0.1)  # past the horizon: stays at the floor


def test_policy_reports_the_lr_of_each_step_with_warmup(base_model):
    batch = with_training_fields(make_batch(batch_size=2), base_model)
    policy = policy_of(fresh(base_model), mini=2, micro=2, lr=1e-3, warmup_steps=2)
    lrs = [policy.update(batch)["actor/lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_an_update_whose_steps_are_skipped_for_a_non_finite_grad_norm_says_so(base_model, caplog):
    # a nan weight makes every gradient nan: each optimizer step is skipped (found_inf), the grad_norm
    # metric reads nan, and the update says how many steps it skipped instead of going on silently
    batch = with_training_fields(make_batch(batch_size=4), base_model)
    model = fresh(base_model)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    policy = policy_of(model, mini=2, micro=2, lr=1e-3)
    with caplog.at_level("WARNING", logger="trainer"):
        metrics = policy.update(batch)
    assert math.isnan(metrics["actor/grad_norm"])
    assert "actor: 2 of 2 optimizer steps skipped for a non-finite grad norm" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):  # the negative control: a finite update is quiet
        policy_of(fresh(base_model), mini=2, micro=2, lr=1e-3).update(batch)
    assert "skipped" not in caplog.text


def test_clip_and_step_clips_the_global_norm_and_skips_non_finite_gradients():
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.data[:] = torch.tensor([[1.0, 1.0]])
    sgd = torch.optim.SGD(model.parameters(), lr=1.0, fused=True)  # the skip is the fused kernel's
    model.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5 -> clipped to 0.5: [0.3, 0.4]
    assert float(clip_and_step(model, sgd, grad_clip=0.5)) == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.data, torch.tensor([[0.7, 0.6]]))
    for bad in (float("nan"), float("inf")):
        model.weight.grad = torch.tensor([[bad, 1.0]])
        assert not math.isfinite(clip_and_step(model, sgd, grad_clip=0.5))
        torch.testing.assert_close(model.weight.data, torch.tensor([[0.7, 0.6]]))  # step skipped
        assert model.weight.grad is None
    model.weight.grad = torch.tensor([[0.3, 0.4]])  # and the next finite step is taken
    clip_and_step(model, sgd, grad_clip=None)
    torch.testing.assert_close(model.weight.data, torch.tensor([[0.4, 0.2]]))


def test_adamw_skips_a_non_finite_step_whole_moments_and_step_count_included(base_model):
    policy = policy_of(fresh(base_model), mini=4, micro=4, lr=1e-2)
    batch = with_training_fields(make_batch(), base_model)
    policy.update(batch)
    before = copy.deepcopy(policy.optimizer.state_dict()), copy.deepcopy(policy.model.state_dict())
    for param in policy.model.parameters():
        param.grad = torch.full_like(param, float("nan"))
    assert math.isnan(clip_and_step(policy.model, policy.optimizer, grad_clip=1.0))
    torch.testing.assert_close(policy.optimizer.state_dict(), before[0])
    torch.testing.assert_close(policy.model.state_dict(), before[1])


def test_model_optimizer_and_scheduler_state_resume_exactly(base_model):
    # a checkpoint saves just these three (trainer/checkpoint.py): nothing else of the policy may matter
    parts = ("model", "optimizer", "scheduler")
    batch = with_training_fields(make_batch(), base_model)
    straight = policy_of(fresh(base_model), mini=4, micro=4, warmup_steps=3)
    straight.update(batch)
    saved = {part: copy.deepcopy(getattr(straight, part).state_dict()) for part in parts}
    straight.update(batch)
    resumed = policy_of(fresh(base_model), mini=4, micro=4, warmup_steps=3)
    for part in parts:
        getattr(resumed, part).load_state_dict(saved[part])
    metrics = resumed.update(batch)
    assert metrics["actor/lr"] == pytest.approx(2 / 3 * 1e-3)  # the schedule resumed at step 1
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=0)


def test_update_rejects_missing_inputs(base_model):
    batch = make_batch(batch_size=2)
    with pytest.raises(ValueError, match="advantages"):
        policy_of(fresh(base_model), mini=2, micro=2).update(batch)
    batch = batch.with_fields(advantages=batch.response_mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_of(fresh(base_model), mini=2, micro=2, loss=loss_settings(use_kl_loss=True)).update(batch)
    with pytest.raises(ValueError, match="must be >= 1"):
        sizes(mini=0)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_bf16_autocast_update_on_gpu(model_dir):
    from trainer.model import default_precision

    precision = default_precision("cuda")
    assert precision.param_dtype == torch.float32 and precision.autocast_dtype == torch.bfloat16
    model = load_policy(str(model_dir), device="cuda")
    policy = Policy(
        model,
        optim(),
        sizes(8, 4),
        loss_settings(),
        log_prob_micro_batch_size=4,
        autocast_dtype=precision.autocast_dtype,
    )
    batch = make_batch()
    fp32 = response_logprobs(load_reference(str(model_dir), device="cuda"), batch.to("cuda"))
    bf16 = policy.compute_logprobs(batch, with_entropy=True)
    assert bf16.logprobs.dtype == torch.float32 and bf16.logprobs.device.type == "cpu"
    torch.testing.assert_close(bf16.logprobs, fp32.logprobs.cpu(), rtol=0, atol=5e-2)
    batch = batch.with_fields(advantages=batch.response_mask, old_logprobs=bf16.logprobs)
    metrics = policy.update(batch)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_an_update_waits_for_the_gpu_once_not_once_a_micro_batch(model_dir, packed):
    # A host sync inside the micro-batch loop (a float() of a loss term, a boolean-mask gather, a pageable
    # copy) stalls the CPU until the GPU drains, and the next forward then starts with an idle GPU (~0.2 s
    # of a 1.5 s update on an H200 through the Ray ranks; BENCHMARKS.md); one before the optimizer step
    # (reading the grad norm) idles it again. Only the metrics' one transfer, after the step, may wait.
    import warnings

    from trainer.packing import use_packed_attention

    model = load_policy(str(model_dir), device="cuda")
    if packed:
        use_packed_attention(model)
    policy = Policy(model, optim(), sizes(8, 2), loss_settings(), autocast_dtype=torch.bfloat16)
    batch = with_training_fields(make_batch(), load_policy(str(model_dir)))  # the same weights, on the CPU
    policy.update(batch)  # warm-up: kernels, allocator, the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = policy.update(batch)  # one mini-batch of four micro-batches
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) <= 1, syncs
    assert math.isfinite(metrics["actor/pg_loss"]) and 0 <= metrics["actor/pg_clipfrac"] <= 1


@pytest.mark.gpu
def test_a_trimmed_host_view_goes_to_the_gpu_through_pinned_memory():
    # A pinned but strided tensor is copied through a pageable temporary, and a pageable copy waits for
    # all the GPU's queued work: it stalled the third micro-batch of a profiled update for 74 ms.
    from torch.profiler import ProfilerActivity, profile

    from trainer.batch import to_device

    view = torch.arange(128 * 400).view(128, 400)[:, 20:390]  # a trimmed micro-batch's columns
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved = to_device(view, "cuda")
        torch.cuda.synchronize()
    copies = [event.name for event in prof.events() if "Memcpy HtoD" in event.name]
    assert copies and not any("Pageable" in name for name in copies), copies
    assert torch.equal(moved.cpu(), view)
