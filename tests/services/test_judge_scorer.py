"""The reward-server's `judge` scorer, both processes real: the reward-server (a subprocess) asks a small
OpenAI-compatible chat endpoint (FastAPI under uvicorn on a loopback port, in this process) to grade its
items. The endpoint counts the requests in flight, so the test can hold the scorer to its bound of
`--judge-concurrency` over two batches sent at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from services.scoring import LocalScorer
from tests.helpers import free_port, service_process

CONCURRENCY = 3
GRADES = {"right": "Score: 9", "half": "Between 3 and 5, so Score: 5", "mumble": "I cannot tell."}


class InFlight:
    def __init__(self) -> None:
        self.now = self.most = self.total = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.total += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def judge_app(counter: InFlight) -> FastAPI:
    """Grades by the word after 'Response: ' in the prompt; holds each request 50 ms so they overlap."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        counter.enter()
        try:
            await asyncio.sleep(0.05)
            content = body["messages"][0]["content"]
            word = re.search(r"Response: (\w+)", content).group(1)
            reply = GRADES.get(word, "Score: 1")
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
        finally:
            counter.leave()

    return app


@pytest.fixture(scope="module")
def judge():
    counter = InFlight()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(judge_app(counter), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the judge endpoint did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", counter
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def reward_server(judge):
    url, _ = judge
    args = ("--math-workers", "1", "--judge-url", url, "--judge-concurrency", str(CONCURRENCY))
    with service_process("services.reward_server", *args, "--log-level", "warning") as (server_url, _):
        yield server_url


def judged(response: str, **fields) -> dict:
    return {
        "data_source": "my/chat-set",
        "response": response,
        "ground_truth": "ref",
        "scorer": "judge",
        **fields,
    }


def test_judge_items_are_graded_batched_and_bounded(judge, reward_server):
    _, counter = judge
    batch = [judged("right"), judged("wrong"), judged("half"), judged("mumble")] * 5
    batch += [
        {
            "data_source": "openai/gsm8k",
            "response": "#### 72",
            "ground_truth": "72",
        },  # other scorers unaffected
        {
            "data_source": "my/chat-set",
            "response": "right",
            "ground_truth": ["a"],
            "extra_info": {"scorer": "judge"},
        },
    ]

    def post() -> list[dict]:
        response = httpx.post(reward_server + "/v1/rewards", json={"items": batch}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["results"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two batches at once share the one bound
        first, second = pool.map(lambda _: post(), range(2))
    assert first == second
    # over the scale of 10: right 9 -> 0.9, wrong 1 -> 0.1, half 5 (the reply's last number) -> 0.5
    assert [r["score"] for r in first[:4]] == [0.9, 0.1, 0.5, 0.0]
    assert [r["correct"] for r in first[:4]] == [True, False, True, False]  # at or above 0.5
    assert first[0]["extracted"] == "Score: 9" and first[0]["error"] is None
    assert first[3]["error"] == "the judge's reply holds no grade: 'I cannot tell.'"
    assert first[20] == {"score": 1.0, "correct": True, "extracted": "72", "error": None}
    assert first[21]["score"] == 0.9  # routed by the row's extra_info.scorer
    assert counter.total == 2 * 21  # one request per judge item, none for the gsm8k item
    assert counter.most == CONCURRENCY  # the bound was reached (the requests overlapped) and never passed

    listed = httpx.get(reward_server + "/v1/scorers").json()["scorers"]
    assert {s["name"]: s["available"] for s in listed}["judge"] is True


def test_judge_unconfigured_or_unreachable_is_each_items_error():
    async def score(**settings):
        async with LocalScorer(math_workers=1, **settings) as scorer:
            return await scorer.score([judged("right")])

    [missing] = asyncio.run(score())
    assert missing.score == 0.0
    assert missing.error == "no judge configured (judge_url: the reward-server's --judge-url)"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    [down] = asyncio.run(score(judge_url=dead, judge_timeout_s=2))
    assert down.score == 0.0 and "ConnectError" in down.error
