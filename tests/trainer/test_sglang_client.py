"""HttpReplica against servers that answer as SGLang 0.5.23 does where it differs from ours, each a real
FastAPI app on a loopback port (SGLang itself cannot run here). The answers follow
srt/entrypoints/http_server.py: /server_info is the server args (no `engine` key; sampling seeds need
enable_deterministic_inference)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter

import pytest
import uvicorn
from fastapi import FastAPI, Request

from tests.helpers import free_port
from trainer.rollout.client import HttpReplica


def sglang_like_app(calls: Counter, *, deterministic: bool) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def count(request: Request, call_next):
        calls[request.url.path] += 1
        return await call_next(request)

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"version": "0.5.23", "tp_size": 1, "enable_deterministic_inference": deterministic}

    @app.post("/generate")
    async def generate(body: dict) -> dict:
        return {"text": "", "output_ids": [1], "meta_info": {"id": "r", "finish_reason": {"type": "length"}}}

    return app


def serve(app: FastAPI):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(params=[True, False], ids=["deterministic", "nondeterministic"])
def sglang_like(request):
    calls = Counter()
    app = sglang_like_app(calls, deterministic=request.param)
    url, server, thread = serve(app)
    yield url, calls, request.param
    server.should_exit = True
    thread.join(timeout=10)


def run(coro_fn, url):
    async def go():
        replica = HttpReplica(url)
        try:
            return await coro_fn(replica)
        finally:
            await replica.close()

    return asyncio.run(go())


def test_seeds_without_deterministic_inference_warn_once(sglang_like, caplog):
    url, calls, deterministic = sglang_like
    body = {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 5, "max_new_tokens": 1}}

    async def twice(replica):
        await replica.generate(body)
        await replica.generate(body)

    with caplog.at_level(logging.WARNING, logger="trainer.rollout.client"):
        run(twice, url)
    warnings = [r for r in caplog.records if "--enable-deterministic-inference" in r.getMessage()]
    assert len(warnings) == (0 if deterministic else 1)
    assert calls["/generate"] == 2 and calls["/get_server_info"] == 1  # the server info is asked once
