"""A batch that ppo_mini_batch_size does not divide (verl's Qwen3 quickstart: 1024 prompts, mini-batches of
80) trains as verl does: full mini-batches, then a smaller last one whose loss uses its own token and
sequence counts.

Shown on the real workers: one update over 6 sequences in mini-batches of 4 (4 + 2) leaves the same
parameters as two updates, one on the first 4 sequences and one on the last 2 alone, with the same
optimizer; and the last mini-batch's loss equals algos.ppo_policy_loss over those 2 sequences with their
own counts (no denominators passed), while over the nominal 4 sequences (or tokens scaled to 4) it
would be half of that, the control computed with the same formula.
"""

import copy

import pytest
import torch

from tests.trainer.test_workers import (
    critic_of,
    flat_params,
    loss_settings,
    make_batch,
    policy_of,
    with_training_fields,
)
from trainer.model import load_critic, load_policy
from testing.tiny import make_tiny_model
from trainer import algos
from trainer.workers.policy import response_logprobs
from trainer.workers.critic import ValueLossSettings


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=5
    )


def relative_gap(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor) -> float:
    return float((a - b).norm() / (b - start).norm())


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_smaller_last_mini_batch_trains_on_its_own_counts(tiny_dir, loss_agg_mode):
    base = load_policy(str(tiny_dir))
    batch = with_training_fields(make_batch(batch_size=6, seed=11), base)
    loss = loss_settings(loss_agg_mode=loss_agg_mode)

    uneven = policy_of(copy.deepcopy(base), mini=4, micro=2, loss=loss)
    metrics = uneven.update(batch)

    separate = policy_of(copy.deepcopy(base), mini=4, micro=4, loss=loss)
    first = separate.update(batch.select(range(4)))
    tail = batch.select(range(4, 6))
    clip = {"clip_ratio_low": loss.clip_ratio_low, "clip_ratio_high": loss.clip_ratio_high}
    with torch.no_grad():  # the last mini-batch's loss by definition: its own tokens and sequences
        logprobs = response_logprobs(separate.model, tail).logprobs
        inputs = (logprobs, tail.old_logprobs, tail.advantages, tail.response_mask)
        own = algos.ppo_policy_loss(*inputs, **clip, loss_agg_mode=loss_agg_mode).loss.item()
        scaled = {"num_tokens": float(tail.response_mask.sum()) * 2, "num_seqs": 4}
        nominal = algos.ppo_policy_loss(*inputs, **clip, loss_agg_mode=loss_agg_mode, **scaled).loss.item()
    last = separate.update(tail)  # 2 sequences: one (smaller) mini-batch, as the uneven split's last
    assert last["actor/pg_loss"] == pytest.approx(own, rel=1e-5, abs=1e-7)
    assert nominal == pytest.approx(own / 2, rel=1e-5)  # the control: that bug would report half

    start = flat_params(base)
    assert (flat_params(separate.model) - start).norm() > 1e-3  # both steps moved the parameters
    assert relative_gap(flat_params(uneven.model), flat_params(separate.model), start) < 1e-4
    # the update's loss is the mean over its two mini-batches, each on its own denominators; abs: fp32
    # rounding of a loss that nearly cancels (seq-mean-token-sum's ~1e-3 here is off by 1.2e-7 with 2
    # torch threads, 3.6e-7 with one, as under `pytest -n 2`), far below a wrong denominator's 50%
    expected = (first["actor/pg_loss"] + last["actor/pg_loss"]) / 2
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_critic_smaller_last_mini_batch_trains_on_its_own_counts(tiny_dir):
    base = load_critic(str(tiny_dir))
    batch = make_batch(batch_size=6, seed=12)
    values = critic_of(copy.deepcopy(base), forward_micro=6).compute_values(batch)
    noise = torch.randn(values.shape, generator=torch.Generator().manual_seed(0))
    batch = batch.with_fields(values=values, returns=values + noise * batch.response_mask)
    loss = ValueLossSettings(cliprange_value=0.2, loss_agg_mode="token-mean")

    uneven = critic_of(copy.deepcopy(base), mini=4, micro=3, loss=loss)
    uneven.update(batch)
    separate = critic_of(copy.deepcopy(base), mini=4, micro=4, loss=loss)
    separate.update(batch.select(range(4)))
    separate.update(batch.select(range(4, 6)))

    start = flat_params(base)
    assert relative_gap(flat_params(uneven.model), flat_params(separate.model), start) < 1e-4
