"""Search-R1 QA scores against verl's own search_r1_like_qa_em.compute_score, row by row, in-process
(verl's module is loaded from .verl when .ci/run installed it; the hand-written values hold without it).
An empty golden-answer list is verl's format_score, never an error."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from services.reward_server.schemas import RewardOptions
from services.scoring import LocalScorer
from tests.helpers import ROOT

VERL_QA = ROOT / ".verl" / "verl" / "utils" / "reward_score" / "search_r1_like_qa_em.py"
# (response, golden answers, format_score, expected score): verl's rule written out
CASES = [
    ("<answer>x</answer>", [], 0.0, 0.0),  # found, nothing to match: format_score
    ("<answer>x</answer>", [], 0.2, 0.2),
    ("no answer tag", [], 0.2, 0.0),  # nothing found: 0 whatever format_score is
    ("<answer>The Paris</answer>", ["paris"], 0.2, 1.0),
    ("<answer>Rome</answer>", ["paris"], 0.2, 0.2),
]


def verl_compute_score():
    if not VERL_QA.exists():
        return None
    spec = importlib.util.spec_from_file_location("verl_search_r1_qa_em", VERL_QA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


@pytest.mark.parametrize("data_source", ["searchR1_nq", "nq", "my_qa_set_hinted"])
def test_qa_em_matches_verl_including_empty_golden_lists(data_source):
    async def score(response, answers, format_score):
        extra = {"scorer": "qa_em"} if data_source == "my_qa_set_hinted" else None
        item = {
            "data_source": data_source,
            "response": response,
            "ground_truth": {"target": answers},
            "extra_info": extra,
        }
        async with LocalScorer(math_workers=1) as scorer:
            [result] = await scorer.score([item], RewardOptions(format_score=format_score))
        return result

    verl = verl_compute_score()
    for response, answers, format_score, expected in CASES:
        result = asyncio.run(score(response, answers, format_score))
        assert result.error is None and result.score == expected, (response, answers, result)
        if verl is not None:
            assert verl(response, {"target": answers}, format_score=format_score) == expected


def test_qa_f1_with_no_golden_answers_is_format_score():
    async def score():
        item = {"data_source": "nq", "response": "<answer>x</answer>", "ground_truth": [], "scorer": "qa_f1"}
        async with LocalScorer(math_workers=1) as scorer:
            return await scorer.score([item], RewardOptions(format_score=0.3))

    [result] = asyncio.run(score())
    assert (result.score, result.correct, result.error) == (0.3, False, None)
