"""The built-in engine behind SGLang's native HTTP API (the subset in rollout/protocol.py).

    python -m trainer.rollout.server --model PATH --port 30000 [--device cuda] [--max-running-requests 256]

Routes are thin: parse, call the LocalReplica (the engine on its own thread), answer. Bad input is a 4xx
naming the problem: 400 for a request the engine refuses, 422 for a body that does not parse, 409 for a
call the engine's state forbids (generating while its memory is released). An engine failure is a 503,
which the trainer's client retries on another replica.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import orjson
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, ready_state
from services.common.errors import ApiError
from services.common.settings import ServiceSettings, add_settings_arguments, settings_from_namespace
from trainer.rollout.protocol import (
    GenerateRequest,
    MemoryOccupationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
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
    return app


# SGLang's native routes; each answers 503 until the replica has loaded.
router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, body: GenerateRequest) -> Response:
    replica = ready_state(request).replica
    outputs = await _answer(replica.generate(body))
    return Response(
        orjson.dumps(outputs[0] if body.is_single and len(outputs) == 1 else outputs),
        media_type="application/json",
    )


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    request: Request, body: UpdateWeightsFromDiskRequest
) -> UpdateWeightsResponse:
    replica = ready_state(request).replica
    await _answer(
        replica.update_weights_from_disk(
            body.model_path, load_format=body.load_format, weight_version=body.weight_version
        )
    )
    return UpdateWeightsResponse(success=True, message="Succeeded to update model weights.")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    request: Request, body: UpdateWeightsFromTensorRequest
) -> UpdateWeightsResponse:
    replica = ready_state(request).replica
    await _answer(
        replica.update_weights_from_serialized(
            body.serialized_named_tensors,
            load_format=body.load_format,
            weight_version=body.weight_version,
        )
    )
    return UpdateWeightsResponse(success=True, message="Succeeded to update model weights.")


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
