"""bench/coin_reward.py: the benchmarks' reward gives random-weight models real GRPO advantages."""

import asyncio
import random
from pathlib import Path

from trainer import algos
from trainer.rewards import CustomFunctionScorer

COIN = Path(__file__).resolve().parents[2] / "bench" / "coin_reward.py"


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh 0123456789") for _ in range(40)) for _ in range(count)]


def test_the_coin_is_fair_and_repeatable_through_the_trainers_scorer():
    scorer = CustomFunctionScorer(str(COIN), "compute_score")
    texts = random_texts(2000, seed=0)
    items = [{"data_source": "openai/gsm8k", "response": t, "ground_truth": "72"} for t in texts]
    first = [r.score for r in asyncio.run(scorer.score(items))]
    again = [r.score for r in asyncio.run(scorer.score(items))]
    assert first == again and set(first) == {0.0, 1.0}
    assert abs(sum(first) / len(first) - 0.5) < 0.05


def test_groups_of_eight_get_non_zero_advantages():
    """What the benchmarks need: GRPO groups whose advantages are not all zero (a random model's GSM8K
    scores are all 0, so the policy gradient would be exactly zero)."""
    import torch

    scorer = CustomFunctionScorer(str(COIN), "compute_score")
    texts = random_texts(8 * 64, seed=1)
    items = [{"data_source": "openai/gsm8k", "response": t, "ground_truth": "72"} for t in texts]
    scores = torch.tensor([r.score for r in asyncio.run(scorer.score(items))])
    mask = torch.ones(len(items), 4)
    advantages = algos.grpo_advantages(scores, torch.arange(64).repeat_interleave(8), mask)
    mixed_groups = (advantages.view(64, 8 * 4).abs().sum(dim=1) > 0).sum().item()
    assert mixed_groups >= 60  # a group is all-equal with probability 2 / 2**8
