"""Code scoring against a code-executor that wants a bearer token (issue 26): the token set in the
scorer's settings (or the reward-server's env REWARD_SERVER_CODE_EXECUTOR_TOKEN) reaches it; without
it every code item fails with the executor's 401, named, and never scores as a wrong program."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid

import httpx
import pytest

from services.scoring import LocalScorer
from tests.helpers import ROOT, code_executor_with_token, service_process

TOKEN = f"exec-{uuid.uuid4().hex}"
ADDER = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
ITEM = {
    "data_source": "codecontests",
    "response": ADDER,
    "ground_truth": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
}


@pytest.fixture(scope="module")
def executor():
    with code_executor_with_token(TOKEN, uid_base=61700) as url:
        yield url


def test_the_token_reaches_the_code_executor(executor):
    async def score(**settings):
        async with LocalScorer(math_workers=1, code_executor_url=executor, **settings) as scorer:
            [result] = await scorer.score([ITEM])
        return result

    good = asyncio.run(score(code_executor_token=TOKEN))
    assert (good.score, good.correct, good.error) == (1.0, True, None)
    refused = asyncio.run(score())
    assert refused.score == 0.0 and refused.error.startswith("code-executor: ") and "401" in refused.error


def test_reward_server_takes_the_token_from_its_environment(executor):
    env = {"REWARD_SERVER_CODE_EXECUTOR_TOKEN": TOKEN}
    args = ("--math-workers", "1", "--code-executor-url", executor, "--log-level", "warning")
    with service_process("services.reward_server", *args, env=env) as (url, _):
        response = httpx.post(url + "/v1/rewards", json={"items": [ITEM]}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["results"] == [
        {"score": 1.0, "correct": True, "extracted": "2/2 cases passed", "error": None}
    ]


def test_serve_reward_hands_the_executors_token_on_by_environment(tmp_path):
    """jobgroup/scripts/serve_reward.sh: CODE_EXECUTOR_AUTH_TOKEN (the code-executor's own setting) reaches
    the reward-server as REWARD_SERVER_CODE_EXECUTOR_TOKEN, never on its command line (`ps` shows that)."""
    stub = tmp_path / "python"
    stub.write_text(
        '#!/usr/bin/env bash\necho "argv: $*"\necho "token: ${REWARD_SERVER_CODE_EXECUTOR_TOKEN:-}"\n'
    )
    stub.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(stub),
        "USE_CODE_EXECUTOR": "1",
        "CODE_EXECUTOR_URL": "http://code:8003",
        "CODE_EXECUTOR_AUTH_TOKEN": TOKEN,
    }
    script = str(ROOT / "jobgroup" / "scripts" / "serve_reward.sh")
    done = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    argv, token = done.stdout.splitlines()
    assert argv == "argv: -m services.reward_server --port 8001 --code-executor-url http://code:8003"
    assert token == f"token: {TOKEN}"
    off = subprocess.run(
        ["bash", script], env={**env, "USE_CODE_EXECUTOR": "0"}, capture_output=True, text=True, timeout=30
    )
    assert off.stdout.splitlines()[1] == "token: "  # no code-executor, no token handed on
