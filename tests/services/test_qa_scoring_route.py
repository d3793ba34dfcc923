"""A QA set served under any dataset name is scored as QA: the data-server's rows say so
(extra_info.scorer) and the reward-server follows, both real processes on loopback. Before, a QA file
served as "hotpot" got "no scorer for data_source 'hotpot'" on every item and trained on zeros."""

import asyncio
import json

import pytest

from services.data_server.client import DataClient
from services.reward_server.client import RewardClient
from tests.helpers import service_process
from trainer.rewards import RewardErrors, check_reward_errors

QUESTIONS = [
    {"question": "who wrote hamlet", "golden_answers": ["Shakespeare", "William Shakespeare"]},
    {"question": "capital of italy", "golden_answers": ["Rome"]},
    {"question": "largest planet", "golden_answers": ["Jupiter"]},
]
VERL_ROW_FIELDS = {"uid", "data_source", "prompt", "ability", "reward_model", "extra_info"}


@pytest.fixture(scope="module")
def qa_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hotpot")
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    return folder


def reward_items(rows: list[dict], answers: list[str]) -> list[dict]:
    """What trainer/rewards.py reward_items sends for these rows (the row's reward fields + a response)."""
    return [
        {
            "data_source": row["data_source"],
            "response": f"<answer>{answer}</answer>",
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": row["extra_info"],
        }
        for row, answer in zip(rows, answers)
    ]


def test_qa_rows_under_any_name_are_scored_as_qa(qa_folder):
    async def scenario(data_url: str, reward_url: str):
        async with DataClient(data_url) as data, RewardClient(reward_url) as rewards:
            batch = await data.batch("hotpot", "train", 3)
            rows = sorted((item.model_dump() for item in batch.items), key=lambda r: r["extra_info"]["index"])
            answers = ["william shakespeare", "Paris", "Jupiter"]
            scored = await rewards.score(reward_items(rows, answers))
            # the negative control: the same items without the rows' hint, as before
            bare = [{**item, "extra_info": {"split": "train"}} for item in reward_items(rows, answers)]
            return rows, scored, await rewards.score(bare)

    with service_process("services.data_server", "--datasets", f"hotpot={qa_folder}") as (data_url, _), \
            service_process("services.reward_server", "--math-workers", "1") as (reward_url, _):  # fmt: skip
        rows, scored, bare = asyncio.run(scenario(data_url, reward_url))

    assert {row["data_source"] for row in rows} == {"hotpot"}  # the dataset's name, as before
    assert all(set(row) >= VERL_ROW_FIELDS for row in rows)  # still verl's row schema
    assert all(row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
               for row in rows)  # fmt: skip
    assert [(r.score, r.correct, r.error) for r in scored] == [(1.0, True, None), (0.0, False, None),
                                                               (1.0, True, None)]  # fmt: skip
    assert all(r.score == 0.0 and "no scorer for data_source 'hotpot'" in r.error for r in bare)
    errors = [r.error for r in bare]
    with pytest.raises(RewardErrors, match=r"3 of 3 rewards could not be computed .*no scorer"):
        check_reward_errors(len(errors), len(bare), 1.0, errors[0])


@pytest.mark.parametrize(
    ("errors", "total", "max_fraction", "stops"),
    [
        (8, 8, 1.0, True),  # the default: all errors stop the run
        (7, 8, 1.0, False),  # ... a partial failure is counted, not fatal
        (4, 8, 0.5, True),  # the threshold is reached
        (3, 8, 0.5, False),
        (1, 8, 0.0, True),  # 0.0: the first error stops
        (0, 8, 0.0, False),  # no error never stops
        (0, 0, 1.0, False),  # nothing scored (e.g. DAPO kept no group)
    ],
)
def test_check_reward_errors(errors, total, max_fraction, stops):
    if stops:
        with pytest.raises(RewardErrors, match=f"{errors} of {total} rewards could not be computed"):
            check_reward_errors(errors, total, max_fraction, "no scorer for data_source 'x'")
    else:
        assert check_reward_errors(errors, total, max_fraction) == (errors / total if total else 0.0)
