"""OpenRLHF's remote reward protocol on the reward-server, and the LLM judge against a real
OpenAI-compatible endpoint (our rollout server's /v1/chat/completions), both over real loopback servers.

/get_reward follows OpenRLHF's openrlhf/utils/remote_rm_utils.py (remote_rm_fn posts {"query", "prompts",
"labels"} and reads "rewards").
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.scoring.judge import JudgeItem, JudgeSettings, LLMJudge, parse_grade
from tests.helpers import free_port, service_process
from tests.trainer.test_rollout_engine import varied_model


@pytest.fixture(scope="module")
def reward_server():
    with service_process("services.reward_server", "--math-workers", "1", "--log-level", "warning") as (
        url,
        _,
    ):
        yield url


@pytest.fixture(scope="module")
def rollout_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge-model")
    model, tok = varied_model("qwen2", seed=3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    args = (
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--max-running-requests",
        "4",
        "--context-length",
        "256",
    )
    with service_process("trainer.rollout.server", *args) as (url, _):
        yield url


def test_get_reward_speaks_openrlhfs_protocol(reward_server):
    prompts = ["Q: 2+3? A:", "Q: 4*5? A:", "Q: 7-1? A:"]
    queries = [prompts[0] + " it is #### 5", prompts[1] + " #### 21", "no prompt prefix #### 6"]
    body = {"query": queries, "prompts": prompts, "labels": ["5", "20", "6"]}
    response = httpx.post(reward_server + "/get_reward", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["rewards"] == [1.0, 0.0, 1.0] == answer["scores"]
    assert answer["extra_logs"]["correct"] == [1.0, 0.0, 1.0]
    short = httpx.post(reward_server + "/get_reward", json={**body, "labels": ["5"]}, timeout=30)
    assert short.status_code == 409 and "labels: 1 entries for 3 queries" in short.json()["error"]
    unlabeled = httpx.post(reward_server + "/get_reward", json={"query": queries}, timeout=30)
    assert unlabeled.status_code == 422 and "labels" in unlabeled.json()["error"]


def test_parse_grade():
    assert parse_grade("Score: 7", 10) == 0.7
    assert parse_grade("between 3 and 12/10", 10) == 1.0  # the last number, clipped
    assert parse_grade("no idea", 10) is None


def test_judge_against_our_rollout_servers_chat_route(rollout_server):
    """Batched and bounded: 5 items through 2 slots; a random tiny model's reply rarely holds a grade,
    so each item comes back with a grade or an error that quotes the reply, never an exception."""
    items = [JudgeItem(prompt=f"{i}+1?", response=str(i + 1), reference=str(i + 1)) for i in range(5)]

    async def run(settings):
        async with LLMJudge(settings) as judge:
            return await judge.score(items)

    results = asyncio.run(run(JudgeSettings(url=rollout_server + "/v1", concurrency=2, max_tokens=8)))
    assert len(results) == 5
    for result in results:
        assert result.reply is not None  # the chat route answered every item
        assert (result.score is None) == (result.error is not None)
        if result.score is None:
            assert "holds no grade" in result.error
    assert len({r.reply for r in results}) >= 1

    dead = JudgeSettings(url=f"http://127.0.0.1:{free_port()}/v1", retries=1, timeout_s=2)
    failed = asyncio.run(run(dead))
    assert all(r.score is None and "ConnectError" in r.error for r in failed)
    refused = asyncio.run(run(JudgeSettings(url=rollout_server + "/v1", max_tokens=1000)))
    assert all("HTTP 400" in r.error and "context length" in r.error for r in refused)
