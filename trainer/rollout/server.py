"""The built-in engine behind SGLang's native HTTP API (the subset in rollout/protocol.py).

    python -m trainer.rollout.server --model PATH --port 30000 [--device cuda] [--max-running-requests 256]

Routes are thin: parse, call the LocalReplica (the engine on its own thread), answer. Every route SGLang's
RL users call is here (protocol.py cites each one's source), plus the OpenAI-compatible ones
(openai_api.py). Bad input is a 400 naming the problem, in SGLang's envelopes (install_sglang_errors);
409 for a call the engine's state forbids (generating while its memory is released). An engine failure
is a 503, which the trainer's client retries on another replica.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Literal

import orjson
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, ready_state
from fastapi.exceptions import RequestValidationError

from services.common.errors import ApiError, describe_validation_errors
from services.common.settings import ServiceSettings, add_settings_arguments, settings_from_namespace
from trainer.rollout.openai_api import openai_error
from trainer.rollout.openai_api import router as openai_router
from trainer.rollout.protocol import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    SGLANG_API_VERSION,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)

log = logging.getLogger("trainer.rollout.server")


class RolloutServerSettings(ServiceSettings):
    """rollout server: the built-in engine behind SGLang's native API (env prefix ROLLOUT_SERVER_)."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_SERVER_", extra="forbid")

    model: str = Field(..., description="Checkpoint folder in transformers format (config + safetensors).")
    tokenizer: str | None = Field(None, description="Tokenizer folder; default: the model's.")
    port: int = Field(30000, ge=0, le=65535, description="TCP port to bind (SGLang's default).")
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: cuda when available.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights and KV cache dtype; auto: bfloat16 on cuda, float32 on cpu."
    )
    max_running_requests: int = Field(256, ge=1, description="KV slots: most sequences decoded together.")
    context_length: int = Field(4096, ge=2, description="Prompt + response tokens per sequence.")
    max_prefill_tokens: int = Field(16384, ge=1, description="Padded prompt tokens per prefill forward.")
    cuda_graphs: bool = Field(True, description="Capture decode steps as CUDA graphs (cuda only).")
    max_request_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="Largest request body (tensor weight updates are large)."
    )


def load_replica(settings: RolloutServerSettings):
    import torch

    from trainer.model import load_tokenizer
    from trainer.rollout.builtin import EngineConfig, load_engine
    from trainer.rollout.builtin.worker import EngineWorker
    from trainer.rollout.local import LocalReplica

    device = (
        settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    tokenizer = load_tokenizer(settings.tokenizer or settings.model)
    config = EngineConfig(
        max_running=settings.max_running_requests,
        context_length=settings.context_length,
        max_prefill_tokens=settings.max_prefill_tokens,
        cuda_graphs=settings.cuda_graphs,
    )
    engine = load_engine(settings.model, tokenizer=tokenizer, dtype=dtype, device=device, config=config)
    engine.warmup()
    return LocalReplica(EngineWorker(engine), tokenizer, model_path=settings.model)


def create_app(settings: RolloutServerSettings) -> FastAPI:
    def load(app: FastAPI) -> None:
        app.state.replica = load_replica(settings)
        app.state.health_info = {"model_path": settings.model}

    def close(app: FastAPI) -> None:
        app.state.replica.worker.close()

    app = create_service_app(
        "rollout-server", settings, load, close, description="The built-in engine behind SGLang's native API."
    )
    app.include_router(router)
    app.include_router(openai_router)
    install_sglang_errors(app)
    return app


def install_sglang_errors(app: FastAPI) -> None:
    """SGLang's error bodies in place of the services' own: a body that does not parse is a 400 with
    the OpenAI-style ErrorResponse (http_server.py's RequestValidationError handler); a request the
    engine refuses is {"error": {"message", "code"}} (its `_create_error_response`)."""

    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return openai_error(
            f"invalid request: {describe_validation_errors(exc.errors())}", 400, "Bad Request"
        )

    async def refused(request: Request, exc: ApiError) -> Response:
        body = {"error": {"message": exc.message, "code": exc.status_code}}
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(ApiError, refused)


# SGLang's native routes; each answers 503 until the replica has loaded.
router = APIRouter()
HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, body: GenerateRequest) -> Response:
    replica = ready_state(request).replica
    outputs = await _answer(replica.generate(body))
    return Response(
        orjson.dumps(outputs[0] if body.is_single and len(outputs) == 1 else outputs),
        media_type="application/json",
    )


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """SGLang's deep health check: one greedy token of prompt [0] within 20 s, else 503."""
    state = request.app.state
    if not state.ready or state.replica.worker.paused:
        return Response(status_code=503)
    probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        await asyncio.wait_for(state.replica.generate(probe), HEALTH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - any failure to generate is what this route reports
        log.warning("health_generate failed", exc_info=True)
        return Response(status_code=503)
    return Response(status_code=200)


@router.post("/abort_request")
async def abort_request(request: Request, body: AbortRequest) -> Response:
    await ready_state(request).replica.abort_request(body.rid or "", body.abort_all)
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationRequest | None = Body(None)) -> dict:
    await ready_state(request).replica.pause_generation(body.mode if body else "abort")
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request, body: dict | None = Body(None)) -> dict:
    await ready_state(request).replica.continue_generation()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict]:
    """The legacy shape (one entry per DP rank) SGLang keeps for routers that poll it."""
    load = ready_state(request).replica.load()
    return [
        {
            "dp_rank": load["dp_rank"],
            "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "num_tokens": load["num_used_tokens"],
            "ts_tic": time.perf_counter(),
        }
    ]


@router.get("/v1/loads")
async def v1_loads(request: Request) -> dict:
    replica = ready_state(request).replica
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": SGLANG_API_VERSION,
        "accelerator": str(replica.engine.device),
        "num_accelerators": 1,
        "loads": [replica.load()],
    }


@router.get("/get_weight_version")
@router.get("/weight_version")
async def get_weight_version(request: Request) -> dict:
    return {"weight_version": ready_state(request).replica.weight_version}


@router.post("/update_weight_version")
async def update_weight_version(request: Request, body: UpdateWeightVersionRequest) -> dict:
    replica = ready_state(request).replica
    if body.abort_all_requests:
        await replica.abort_request(abort_all=True)
    replica.weight_version = body.new_version
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, body: UpdateWeightsFromDiskRequest) -> Response:
    replica = ready_state(request).replica
    if body.abort_all_requests:
        await replica.abort_request(abort_all=True)
    update = replica.update_weights_from_disk(
        body.model_path, load_format=body.load_format, weight_version=body.weight_version
    )
    return await _weights_answer(update, "Succeeded to update model weights.", num_paused_requests=0)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, body: UpdateWeightsFromTensorRequest) -> Response:
    replica = ready_state(request).replica
    update = replica.update_weights_from_serialized(
        body.serialized_named_tensors, load_format=body.load_format, weight_version=body.weight_version
    )
    return await _weights_answer(update, "Succeeded to update model weights.")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, body: InitWeightsUpdateGroupRequest) -> Response:
    replica = ready_state(request).replica
    join = replica.init_weights_update_group(**body.model_dump())
    return await _weights_answer(join, "Succeeded to initialize custom process group.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, body: DestroyWeightsUpdateGroupRequest) -> Response:
    destroy = ready_state(request).replica.destroy_weights_update_group(body.group_name)
    return await _weights_answer(destroy, "Succeeded to destroy custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    request: Request, body: UpdateWeightsFromDistributedRequest
) -> Response:
    replica = ready_state(request).replica
    if body.abort_all_requests:
        await replica.abort_request(abort_all=True)
    update = replica.update_weights_from_distributed(
        names=body.names,
        dtypes=body.dtypes,
        shapes=body.shapes,
        group_name=body.group_name,
        weight_version=body.weight_version,
    )
    return await _weights_answer(update, "Succeeded to update parameter online.")


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> PlainTextResponse:
    await ready_state(request).replica.flush_cache()
    return PlainTextResponse("Cache flushed.\n")


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(
    request: Request, body: MemoryOccupationRequest | None = Body(None)
) -> None:
    await _answer(ready_state(request).replica.release_memory_occupation(body.tags if body else None))


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(
    request: Request, body: MemoryOccupationRequest | None = Body(None)
) -> None:
    await _answer(ready_state(request).replica.resume_memory_occupation(body.tags if body else None))


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> dict:
    return ready_state(request).replica.model_info()


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict:
    return ready_state(request).replica.server_info()


async def _weights_answer(awaitable, success: str, **extra) -> Response:
    """SGLang's weight routes: 200 {"success": true, "message"}, or 400 with success false."""
    try:
        await _answer(awaitable)
    except ApiError as exc:
        if exc.status_code != 400:
            raise
        body = {"success": False, "message": exc.message, **extra}
        return Response(orjson.dumps(body), status_code=400, media_type="application/json")
    return Response(
        orjson.dumps({"success": True, "message": success, **extra}), media_type="application/json"
    )


async def _answer(awaitable):
    """Run a replica call; map what it raises to the status the caller can act on."""
    from trainer.rollout.builtin.engine import EngineStateError
    from trainer.rollout.builtin.worker import EngineError
    from trainer.rollout.client import ReplicaDown

    try:
        return await awaitable
    except EngineStateError as exc:
        raise ApiError(409, str(exc)) from exc
    except (EngineError, ReplicaDown) as exc:
        raise ApiError(503, str(exc)) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise ApiError(400, str(exc)) from exc


def main(argv: list[str] | None = None) -> None:
    import argparse

    from services.common.app import serve

    parser = argparse.ArgumentParser(prog="python -m trainer.rollout.server", description=__doc__)
    add_settings_arguments(parser, RolloutServerSettings)
    settings = settings_from_namespace(
        RolloutServerSettings, parser.parse_args(sys.argv[1:] if argv is None else argv)
    )
    serve(create_app(settings), settings)


if __name__ == "__main__":
    main()
