"""HttpReplica against servers that answer as SGLang 0.5.23 does where it differs from ours, each a real
FastAPI app on a loopback port (SGLang itself cannot run here). The answers follow
srt/entrypoints/http_server.py: /server_info is the server args (no `engine` key; sampling seeds need
enable_deterministic_inference), /model_info carries weight_version, and there is no
/get_weight_version; an older release's /model_info had no weight_version but that route."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.helpers import free_port
from trainer.rollout.client import HttpReplica, RolloutRequestError


def sglang_like_app(calls: Counter, *, deterministic: bool, weight_version_in_model_info: bool) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def count(request: Request, call_next):
        calls[request.url.path] += 1
        return await call_next(request)

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"version": "0.5.23", "tp_size": 1, "enable_deterministic_inference": deterministic}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        info = {"model_path": "/m", "is_generation": True}
        return {**info, "weight_version": "w-7"} if weight_version_in_model_info else info

    @app.get("/get_weight_version")
    async def weight_version():
        if weight_version_in_model_info:  # 0.5.23 has no such route
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"weight_version": "old-3"}

    @app.post("/generate")
    async def generate(body: dict) -> dict:
        return {"text": "", "output_ids": [1], "meta_info": {"id": "r", "finish_reason": {"type": "length"}}}

    @app.post("/update_weights_from_tensor")
    async def from_tensor() -> dict:
        return {"success": True, "message": "would have been a CUDA-IPC load"}

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


@pytest.fixture(params=[True, False], ids=["sglang-0.5.23", "older-sglang"])
def sglang_like(request):
    calls = Counter()
    app = sglang_like_app(calls, deterministic=request.param, weight_version_in_model_info=request.param)
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


def test_tensor_updates_are_refused_before_sending_to_sglang(sglang_like):
    url, calls, _ = sglang_like

    async def update(replica):
        await replica.update_weights_from_tensor({"w": torch.zeros(2)})

    with pytest.raises(RolloutRequestError, match="update_weights_from_disk") as caught:
        run(update, url)
    assert "only the built-in rollout server" in str(caught.value)
    assert calls["/update_weights_from_tensor"] == 0  # refused here, nothing sent


def test_weight_version_from_model_info_else_the_old_route(sglang_like):
    url, calls, new = sglang_like
    assert run(lambda replica: replica.get_weight_version(), url) == ("w-7" if new else "old-3")
    assert calls["/get_weight_version"] == (0 if new else 1)


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
