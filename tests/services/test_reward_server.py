"""reward-server as a real process: timeouts, bad input, item errors, seed routes, async client, verl hook."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from pydantic import TypeAdapter

from services.common.client import ServiceError
from services.reward_server import verl_compat
from services.reward_server.client import RewardClient, chunk_items, encode_item
from services.scoring import LocalScorer, scorer_for
from services.reward_server.schemas import RewardItem, RewardItemDict, RewardOptions
from tests.helpers import ROOT, free_port, service_process

HANG = "\\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate a number with ~10^(3.7e8) digits
MATH_TIMEOUT_S = 1.5
MAX_ITEMS = 64


@pytest.fixture(scope="module")
def server():
    args = [
        "--math-workers",
        "2",
        "--math-timeout-s",
        str(MATH_TIMEOUT_S),
        "--max-items",
        str(MAX_ITEMS),
        "--max-string-chars",
        "5000",
        "--max-request-bytes",
        "200000",
        "--log-level",
        "warning",
    ]
    with service_process("services.reward_server", *args) as (url, _):
        yield url


def rewards(url, items, options=None):
    response = httpx.post(url + "/v1/rewards", json={"items": items, "options": options}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def gsm8k(response, truth="72"):
    return {"data_source": "openai/gsm8k", "response": response, "ground_truth": truth}


def math(response, truth):
    return {"data_source": "lighteval/MATH", "response": response, "ground_truth": truth}


def qa(response, answers=("Paris",)):
    return {"data_source": "nq", "response": response, "ground_truth": {"target": list(answers)}}


def requests_served(url) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(
        r'reward_server_requests_total\{method="POST",route="/v1/rewards",status="200"\} (\S+)', text
    )
    return float(found.group(1)) if found else 0.0


def test_pathological_math_times_out_while_the_rest_is_scored(server):
    batch = [
        math(HANG, "1"),
        math("\\boxed{\\frac{1}{2}}", "0.5"),
        gsm8k("#### 72"),
        math(HANG, "2"),
        qa("<answer>Paris</answer>"),
        math("\\boxed{3}", "3"),
    ]
    answer, health_latencies = {}, []

    def score():
        start = time.monotonic()
        answer["results"] = rewards(server, batch)
        answer["elapsed"] = time.monotonic() - start

    worker = threading.Thread(target=score)
    worker.start()
    with httpx.Client(timeout=5) as probe:  # one client: building one per call costs ~70 ms on a busy host
        while worker.is_alive():  # the event loop must keep answering while both math workers are stuck
            start = time.monotonic()
            assert probe.get(server + "/health").status_code == 200
            health_latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    worker.join()
    results = answer["results"]
    for index in (0, 3):
        assert results[index] == {
            "score": 0.0,
            "correct": False,
            "extracted": None,
            "error": f"math-verify: timed out after {MATH_TIMEOUT_S:g}s",
        }
    assert [r["score"] for r in results] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert all(r["error"] is None for i, r in enumerate(results) if i not in (0, 3))
    # both hung items ran side by side on the two workers; the rest were scored by their replacements
    assert MATH_TIMEOUT_S <= answer["elapsed"] < MATH_TIMEOUT_S + 6
    assert len(health_latencies) >= 10 and max(health_latencies) < 0.5
    assert rewards(server, [math("\\boxed{0.25}", "\\frac14")])[0]["score"] == 1.0
    assert (
        re.search(r"reward_server_math_timeouts (\d+)", httpx.get(server + "/metrics").text).group(1) == "2"
    )


BAD_REQUESTS = [
    ({"items": [{"data_source": "nq", "response": "x"}]}, 422, "items.0.ground_truth: Field required"),
    (
        {"items": [{"data_source": "nq", "response": 5, "ground_truth": "x"}]},
        422,
        "items.0.response: Input should be a valid string",
    ),
    ({"items": [{"data_source": "nq", "response": "x", "ground_truth": 5}]}, 422, "items.0.ground_truth"),
    (
        {"items": [gsm8k("a"), {"response": "x", "ground_truth": "1"}]},
        422,
        "items.1.data_source: Field required",
    ),
    ({"items": [{**gsm8k("x"), "scorer": "regex"}]}, 422, "items.0.scorer"),
    ({"items": [{**gsm8k("x"), "reward": 1}]}, 422, "items.0.reward: Extra inputs are not permitted"),
    ({"items": "nope"}, 422, "items"),
    ({}, 422, "items: Field required"),
    ({"items": [], "options": {"bogus": 1}}, 422, "options.bogus"),
    ({"items": [], "options": {"gsm8k_method": "loose"}}, 422, "options.gsm8k_method"),
    ({"items": [], "options": {"format_bonus": -1}}, 422, "options.format_bonus"),
    ({"items": [], "options": {"format_score": 1e308}}, 422, "options.format_score: Input should be less"),
    ({"items": [], "options": {"overlong_max_len": True}}, 422, "options.overlong_max_len"),
    ({"items": [], "options": {"format_bonus": "0.5"}}, 422, "options.format_bonus: Input should be a valid"),
    (
        {"items": [gsm8k("x")] * (MAX_ITEMS + 1)},
        413,
        "items: 65 items, more than the limit of 64 per request",
    ),
    (
        {"items": [gsm8k("#### 1"), gsm8k("x" * 5001)]},
        413,
        "items.1.response: 5001 characters, more than the limit of 5000",
    ),
    ({"items": [gsm8k("1", truth="9" * 5001)]}, 413, "items.0.ground_truth: 5001 characters"),
    ({"items": [gsm8k("x" * 4000)] * 60}, 413, "request body larger than the limit of 200000 bytes"),
]


@pytest.mark.parametrize("body, status, needle", BAD_REQUESTS)
def test_bad_input_is_a_clear_4xx(server, body, status, needle):
    response = httpx.post(server + "/v1/rewards", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]


def test_bad_json_and_seed_route_errors(server):
    response = httpx.post(server + "/v1/rewards", content=b'{"items": [', timeout=10)
    assert response.status_code == 422 and "body: invalid JSON" in response.json()["error"]
    response = httpx.post(server + "/v1/rewards", content=b"[1, 2]", timeout=10)
    assert (
        response.status_code == 422 and "body: Input should be a valid dictionary" in response.json()["error"]
    )
    response = httpx.post(server + "/reward", json={"prompt": "p", "ground_truth": "1"}, timeout=10)
    assert response.status_code == 422 and "response: Field required" in response.json()["error"]
    items = [{"prompt": "p", "response": "#### 1", "ground_truth": "1"}] * (MAX_ITEMS + 1)
    response = httpx.post(server + "/batch_reward", json={"items": items}, timeout=10)
    assert response.status_code == 413 and "65 items" in response.json()["error"]


def test_items_that_cannot_be_scored_get_an_error_and_the_batch_still_answers(server):
    results = rewards(
        server,
        [
            {"data_source": "my/new-dataset", "response": "#### 72", "ground_truth": "72"},
            gsm8k("#### 72", truth=["72"]),
            {"data_source": "nq", "response": "<answer>x</answer>", "ground_truth": {"answers": ["x"]}},
            {"data_source": "nq", "response": "<answer>x</answer>", "ground_truth": {"target": []}},
            math("\\boxed{1}", ["1"]),
            {**gsm8k("#### 72"), "scorer": "model"},
            math("\\boxed{1}", "\\frac{"),
            gsm8k("#### 72"),
        ],
    )
    errors = [r["error"] for r in results]
    assert errors[0].startswith("no scorer for data_source 'my/new-dataset'; set `scorer`")
    assert errors[1] == "gsm8k ground_truth must be a string such as '72'"
    assert errors[2] == "QA ground_truth must be {'target': [answers...]}"
    assert errors[3] is None  # verl: an empty golden list matches nothing, so format_score (0.0), no error
    assert errors[4] == "math ground_truth must be a string (LaTeX or plain)"
    assert errors[5] == "no reward model loaded (start the server with --reward-model)"
    assert errors[6].startswith("math-verify: ValueError: cannot read the ground truth")
    assert errors[7] is None and results[7]["score"] == 1.0
    assert all(r["score"] == 0.0 and r["correct"] is False for r in results[:7])
    # overlong shaping without the token count is that item's error, not a guess
    missing = rewards(
        server,
        [gsm8k("#### 72"), {**gsm8k("#### 72"), "extra_info": {"response_length": 10}}],
        {"overlong_enable": True, "overlong_max_len": 100, "overlong_buffer_len": 20},
    )
    assert missing[0]["error"].startswith("overlong shaping needs extra_info.response_length")
    assert missing[1] == {"score": 1.0, "correct": True, "extracted": "72", "error": None}
    assert rewards(server, []) == []


def test_explicit_scorer_overrides_data_source(server):
    results = rewards(
        server,
        [
            {
                "data_source": "openai/gsm8k",
                "response": "<answer>Paris</answer>",
                "ground_truth": ["Paris"],
                "scorer": "qa_em",
            },
            {
                "data_source": "nq",
                "response": "\\boxed{\\frac{1}{2}}",
                "ground_truth": "0.5",
                "scorer": "math",
            },
        ],
    )
    assert [r["score"] for r in results] == [1.0, 1.0]


@pytest.mark.parametrize(
    "source, scorer",
    [
        ("openai/gsm8k", "gsm8k"),
        ("synthetic-arith", "gsm8k"),
        ("gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("math_dapo", "math"),
        ("aime2024", "math"),
        ("numina_olympiads", "math"),
        ("my-math-set", "math"),
        ("nq", "qa_em"),
        ("triviaqa", "qa_em"),
        ("popqa", "qa_em"),
        ("hotpotqa", "qa_em"),
        ("2wikimultihopqa", "qa_em"),
        ("musique", "qa_em"),
        ("bamboogle", "qa_em"),
        ("searchR1_nq", "qa_em"),
        ("openai/humaneval", None),
        ("", None),
    ],
)
def test_dispatch_by_data_source(source, scorer):
    assert scorer_for(source) == scorer


def test_seed_routes(server):
    one = httpx.post(
        server + "/reward", json={"prompt": "q", "response": "so #### 1,234", "ground_truth": "1234"}
    ).json()
    assert one == {
        "reward": 1.0,
        "correct": True,
        "extracted_answer": "1234",
        "details": "gsm8k strict (#### answer)",
    }
    two = httpx.post(
        server + "/reward", json={"prompt": "q", "response": "It costs $18.", "ground_truth": "18"}
    ).json()
    assert two == {
        "reward": 1.0,
        "correct": True,
        "extracted_answer": "18",
        "details": "gsm8k last number (no ####)",
    }
    batch = httpx.post(
        server + "/batch_reward",
        json={
            "items": [
                {
                    "prompt": "q",
                    "response": "#### 1000",
                    "ground_truth": "1,000",
                },  # the seed's truths may keep commas
                {"prompt": "q", "response": "I think 7, then #### 8", "ground_truth": "8"},
                {"prompt": "q", "response": "no idea", "ground_truth": "8"},
                {
                    "prompt": "q",
                    "response": "#### 9\nbut 8 is my final",
                    "ground_truth": "8",
                },  # #### wins over the last number
            ]
        },
    ).json()
    assert [r["reward"] for r in batch["rewards"]] == [1.0, 1.0, 0.0, 0.0]
    assert batch["rewards"][2] == {
        "reward": 0.0,
        "correct": False,
        "extracted_answer": None,
        "details": "no number found in the response",
    }
    assert batch["accuracy"] == 0.5


def test_scorers_health_metrics_and_docs(server):
    listed = httpx.get(server + "/v1/scorers").json()
    names = ["gsm8k", "math", "qa_em", "qa_f1", "code", "model", "judge"]
    assert [s["name"] for s in listed["scorers"]] == names
    assert [s["available"] for s in listed["scorers"]] == [True, True, True, True, False, False, False]
    assert listed["limits"] == {
        "max_items": 64,
        "max_string_chars": 5000,
        "max_request_bytes": 200000,
        "math_timeout_s": 1.5,
        "request_deadline_s": 120.0,
    }
    assert listed["default_options"] == RewardOptions().model_dump()
    health = httpx.get(server + "/health").json()
    assert health["math_workers"] == 2 and health["reward_model"] is None
    rewards(server, [gsm8k("#### 72"), {"data_source": "??", "response": "", "ground_truth": ""}])
    metrics = httpx.get(server + "/metrics").text
    assert re.search(r'reward_server_items_total\{scorer="gsm8k"\} [1-9]', metrics)
    assert re.search(r'reward_server_item_errors_total\{scorer="none"\} [1-9]', metrics)
    schema = httpx.get(server + "/openapi.json").json()
    body = schema["paths"]["/v1/rewards"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/RewardsRequest"}
    assert "ground_truth" in schema["components"]["schemas"]["RewardItem"]["properties"]


def test_wire_typeddict_matches_the_model():
    """The server validates with RewardItemDict; it must accept exactly what RewardItem does."""

    def shape(schema: dict) -> tuple:
        fields = {
            name: {k: v for k, v in spec.items() if k not in ("description", "default", "title")}
            for name, spec in schema["properties"].items()
        }
        return fields, sorted(schema["required"])

    assert shape(TypeAdapter(RewardItemDict).json_schema()) == shape(RewardItem.model_json_schema())


def mixed_items(n: int) -> list[RewardItem]:
    makers = [
        lambda i: RewardItem(
            data_source="openai/gsm8k", response=f"... #### {i}", ground_truth=str(i - i % 2)
        ),
        lambda i: RewardItem(
            data_source="lighteval/MATH", response=f"\\boxed{{\\frac{{{i}}}{{2}}}}", ground_truth=str(i / 2)
        ),
        lambda i: RewardItem(
            data_source="searchR1_nq",
            response=f"<answer>The {i} Beatles</answer>",
            ground_truth={"target": [f"{i} beatles"] if i % 3 else ["stones"]},
        ),
        lambda i: RewardItem(data_source="unknown", response="x", ground_truth="y"),
    ]
    return [makers[i % 4](i) for i in range(n)]


def test_async_client_chunks_to_the_server_limit_and_matches_the_local_scorer(server):
    items = mixed_items(150)
    options = RewardOptions(format_score=0.1, format_bonus=0.05)

    async def run():
        async with RewardClient(server, retries=1) as client:
            await client.wait_healthy(10)
            return await client.score(items, options)

    before = requests_served(server)
    remote = asyncio.run(run())
    assert requests_served(server) - before == 3  # 150 items at most 64 a request: 64 + 64 + 22

    async def local():
        async with LocalScorer(math_workers=1) as scorer:
            return await scorer.score(items, options)

    assert remote == asyncio.run(local())
    assert sum(r.correct for r in remote) > 40 and sum(r.error is not None for r in remote) == 37


def test_async_client_raises_on_refusal_and_on_unreachable(server):
    async def run(url, items):
        async with RewardClient(url, retries=1, backoff_s=0.01) as client:
            return await client.score(items)

    with pytest.raises(ServiceError, match="413.*items.0.response: 6000 characters") as refused:
        asyncio.run(run(server, [RewardItem(data_source="nq", response="x" * 6000, ground_truth="x")]))
    assert refused.value.status_code == 413
    with pytest.raises(ServiceError, match="gave up after 2 attempts"):
        asyncio.run(run(f"http://127.0.0.1:{free_port()}", mixed_items(2)))


def test_chunking_respects_items_and_bytes():
    encoded = [encode_item(item) for item in mixed_items(10)]
    sizes = [len(e) + 1 for e in encoded]
    assert list(chunk_items(encoded, 4, 10**9)) == [(0, 4), (4, 8), (8, 10)]
    budget = sizes[0] + sizes[1] + sizes[2]  # exactly three items fit the first chunk
    chunks = list(chunk_items(encoded, 100, budget))
    assert chunks[0] == (0, 3)
    assert all(sum(sizes[a:b]) <= budget for a, b in chunks)
    assert [i for a, b in chunks for i in range(a, b)] == list(range(10))
    assert list(chunk_items([b"x" * 50], 4, 10)) == [
        (0, 1)
    ]  # one item too large still goes (the server judges)


@pytest.mark.parametrize(
    "flag, value",
    [("--code-executor-url", ""), ("--code-executor-url", "127.0.0.1:8003"), ("--judge-url", "")],
)
def test_a_url_that_cannot_work_is_refused_at_startup_in_one_line(flag, value):
    """An empty --code-executor-url (an unset variable in a launch script) switched scorer 'code' on, and
    then every request with a code item was a 500 ("no service URL given"); now the server will not start."""
    result = subprocess.run(
        [sys.executable, "-m", "services.reward_server", flag, value, "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    field = flag.removeprefix("--").replace("-", "_")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: invalid settings: {field}: Value error, {value!r} is not an http:// or https:// URL "
        "(leave it unset to turn its scorer off)"
    ]


def test_verl_compute_score_per_item_and_batched(server, monkeypatch):
    monkeypatch.setenv("REWARD_SERVER_URL", server)
    assert verl_compat.compute_score("openai/gsm8k", "#### 72", "72") == {"score": 1.0, "acc": 1.0}
    assert verl_compat.compute_score(
        data_source="nq",
        solution_str="<answer>Paris</answer>",
        ground_truth={"target": np.array(["Paris"])},
        extra_info={"index": np.int64(3)},
    ) == {"score": 1.0, "acc": 1.0}
    n = 100  # more than the server's 64 per request
    batched = verl_compat.compute_score(
        data_sources=np.array(["openai/gsm8k"] * n),
        solution_strs=[f"#### {i}" for i in range(n)],
        ground_truths=[str(i if i % 4 else -1) for i in range(n)],
        extra_infos=[{"split": "test", "index": i} for i in range(n)],
    )
    assert [r["acc"] for r in batched] == [float(i % 4 != 0) for i in range(n)]
    positional = verl_compat.compute_score(
        ["openai/gsm8k", "bogus"], ["#### 1", "#### 1"], ["1", "1"], [None, None]
    )
    assert positional == [{"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}]


def test_verl_compute_score_never_returns_a_silent_zero(monkeypatch):
    monkeypatch.delenv("REWARD_SERVER_URL", raising=False)
    with pytest.raises(RuntimeError, match="REWARD_SERVER_URL is not set"):
        verl_compat.compute_score("openai/gsm8k", "#### 72", "72")
    monkeypatch.setenv("REWARD_SERVER_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("REWARD_SERVER_RETRIES", "1")
    with pytest.raises(ServiceError, match="gave up after 2 attempts"):
        verl_compat.compute_score("openai/gsm8k", "#### 72", "72")
