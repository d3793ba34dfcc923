"""Errors the trainer handles on a fallback path are said, and the ones that are not the fallback's to
handle (a refused token, a live rank's failed cancellation) are not turned into a quieter path or the
model's fault. The out-of-memory cases of trainer/workers/logprobs.py `add_weight_grad` and
trainer/packing.py `varlen_causal_attention` (re-raised, the fast path kept) need a GPU to happen and
are not faked here."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from tests.helpers import code_executor_with_token
from trainer.agent.code import CodeExecutorClient, CodeTool
from trainer.agent.tools import CodeToolSpec
from trainer.parallel.placement import _settled

TOKEN = f"exec-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def executor():
    with code_executor_with_token(TOKEN, uid_base=61800) as url:
        yield url


def test_a_code_executor_that_refuses_the_token_is_a_tool_failure_not_an_invalid_call(executor):
    # /health asks for no token, so a wrong services.auth_token passes the start; every code call then
    # came back as the model's invalid call (tool/invalid_calls), which no policy treats as an outage
    async def call(token: str | None):
        client = CodeExecutorClient([executor], retries=0, timeout_s=30, token=token)
        try:
            return await CodeTool(client, CodeToolSpec(urls=(executor,))).call({"code": "print(6 * 7)"})
        finally:
            await client.aclose()

    refused = asyncio.run(call("not-the-token"))
    assert refused.status == "failed" and "401" in refused.error
    ran = asyncio.run(call(TOKEN))  # the negative control: the same call with the token runs
    assert ran.status != "failed" and "42" in ran.text


def test_a_cancellation_a_live_rank_failed_is_logged(caplog):
    async def failed():
        raise ValueError("no such batch")

    with caplog.at_level(logging.WARNING, logger="trainer"):
        asyncio.run(_settled(failed()))
    assert any(
        "cancel_rollouts failed" in r.getMessage() and "no such batch" in r.getMessage()
        for r in caplog.records
    )


def test_a_cancellation_a_dead_rank_cannot_hear_is_quiet(caplog):
    from ray.exceptions import RayActorError

    async def gone():
        raise RayActorError()

    with caplog.at_level(logging.WARNING, logger="trainer"):
        asyncio.run(_settled(gone()))
    assert not caplog.records
