"""reward-server: routes and settings. Scoring lives in core.py (LocalScorer) and scorers/.

`POST /v1/rewards` is the hot path (a trainer sends thousands of items a step), so it reads its body
itself: orjson, then one TypedDict validation for the whole batch, then JSON bytes out; no pydantic
model per item (schemas.py says why). Every other route is ordinary FastAPI.
"""

from __future__ import annotations

import collections
import logging

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, require_ready
from services.common.errors import ApiError
from services.common.settings import ServiceSettings
from services.reward_server.core import DEFAULT_OPTIONS, SCORER_DOCS, LocalScorer, Scored, ScorerSettings
from services.reward_server.schemas import (
    REWARDS_REQUEST,
    Limits,
    RewardsRequest,
    RewardsResponse,
    ScorerInfo,
    ScorersResponse,
    SeedBatchRequest,
    SeedBatchResult,
    SeedRewardRequest,
    SeedRewardResult,
)
from services.reward_server.scorers import gsm8k

log = logging.getLogger("services.reward_server")

MAX_REPORTED_ERRORS = 20  # a batch of 4096 bad items should not produce a 4096-line message


class RewardServerSettings(ScorerSettings, ServiceSettings):
    """reward-server: gsm8k, math-verify, QA and reward-model scoring (env prefix REWARD_SERVER_)."""

    model_config = SettingsConfigDict(env_prefix="REWARD_SERVER_", extra="forbid")

    port: int = Field(8001, ge=0, le=65535, description="TCP port to bind.")
    max_request_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    max_items: int = Field(16384, ge=1, description="Most items in one request; more get 413.")
    max_string_chars: int = Field(
        262144, ge=1, description="Longest response / prompt / ground_truth string; longer ones get 413."
    )


def parse_body(body: bytes, adapter: TypeAdapter):
    """JSON bytes -> validated data, or the 422 FastAPI would give (fields named as the caller wrote them)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": "JSON decode error",
                    "ctx": {"error": str(exc)},
                }
            ]
        ) from None
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in errors[:MAX_REPORTED_ERRORS]]
        ) from None


def check_sizes(items: list, max_items: int, max_chars: int) -> None:
    """413 naming the first thing over a limit: the item count, or one item's string field."""
    if len(items) > max_items:
        raise ApiError(
            413, f"items: {len(items)} items, more than the limit of {max_items} per request; split the batch"
        )
    for index, item in enumerate(items):
        for field in ("response", "prompt", "ground_truth"):
            value = item.get(field) if isinstance(item, dict) else getattr(item, field, None)
            if isinstance(value, str) and len(value) > max_chars:
                raise ApiError(
                    413, f"items.{index}.{field}: {len(value)} characters, more than the limit of {max_chars}"
                )


def encode_results(scored: list[Scored]) -> bytes:
    return orjson.dumps(
        {
            "results": [
                {"score": s.score, "correct": s.correct, "extracted": s.extracted, "error": s.error}
                for s in scored
            ]
        }
    )


def document_body(app: FastAPI, path: str, model: type[BaseModel]) -> None:
    """Put `model` in the OpenAPI doc as the body of `path`, whose route reads the body itself."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        return schema

    app.openapi = openapi


class ScoringMetrics:
    """Items scored and failed per scorer, and the math pool's timeouts and crashes."""

    def __init__(self, registry, app: FastAPI) -> None:
        self.items = Counter("reward_server_items_total", "Items scored", ["scorer"], registry=registry)
        self.errors = Counter(
            "reward_server_item_errors_total", "Items that got an error", ["scorer"], registry=registry
        )

        def pool_counter(attribute: str):
            def read() -> int:
                pool = getattr(getattr(app.state, "scorer", None), "math_pool", None)
                return getattr(pool, attribute, 0)

            return read

        Gauge(
            "reward_server_math_timeouts", "Math items killed at the deadline", registry=registry
        ).set_function(pool_counter("timeouts"))
        Gauge("reward_server_math_crashes", "Math workers that died", registry=registry).set_function(
            pool_counter("crashes")
        )

    def count(self, scored: list[Scored]) -> None:
        outcomes = collections.Counter((s.scorer, s.error is not None) for s in scored)
        for (scorer, failed), n in outcomes.items():
            self.items.labels(scorer).inc(n)
            if failed:
                self.errors.labels(scorer).inc(n)


def create_app(settings: RewardServerSettings | None = None, scorer: LocalScorer | None = None) -> FastAPI:
    settings = settings or RewardServerSettings()

    def load(app: FastAPI) -> None:
        app.state.scorer = scorer or LocalScorer(settings)
        app.state.health_info = {
            "scorers": [name for name in SCORER_DOCS if app.state.scorer.available(name)],
            "math_workers": app.state.scorer.settings.math_workers,
            "reward_model": app.state.scorer.settings.reward_model,
        }

    def close(app: FastAPI) -> None:
        if scorer is None:  # only what load() made; a scorer passed in belongs to the caller
            app.state.scorer.close()

    app = create_service_app("reward-server", settings, load=load, close=close, description=__doc__ or "")
    metrics = ScoringMetrics(app.state.metrics.registry, app)

    def get_scorer(state=Depends(require_ready)) -> LocalScorer:
        return state.scorer

    @app.post("/v1/rewards", response_model=RewardsResponse, tags=["rewards"])
    async def rewards(request: Request, scorer: LocalScorer = Depends(get_scorer)) -> Response:
        """Score a batch; an item that cannot be scored gets `error` and score 0, the rest are unaffected."""
        parsed = parse_body(await request.body(), REWARDS_REQUEST)
        items = parsed["items"]
        check_sizes(items, settings.max_items, settings.max_string_chars)
        scored = await scorer.score_items(items, parsed.get("options"))
        metrics.count(scored)
        return Response(encode_results(scored), media_type="application/json")

    document_body(app, "/v1/rewards", RewardsRequest)

    @app.get("/v1/scorers", response_model=ScorersResponse, tags=["rewards"])
    def scorers(scorer: LocalScorer = Depends(get_scorer)) -> ScorersResponse:
        return ScorersResponse(
            scorers=[
                ScorerInfo(name=name, **doc._asdict(), available=scorer.available(name))
                for name, doc in SCORER_DOCS.items()
            ],
            default_options=DEFAULT_OPTIONS,
            limits=Limits(
                max_items=settings.max_items,
                max_string_chars=settings.max_string_chars,
                max_request_bytes=settings.max_request_bytes,
                math_timeout_s=scorer.settings.math_timeout_s,
            ),
        )

    @app.post("/reward", response_model=SeedRewardResult, tags=["seed-compatible"])
    def seed_reward(item: SeedRewardRequest, _=Depends(require_ready)) -> SeedRewardResult:
        """The seed example's route. Items carry no data_source: gsm8k strict, else the last number."""
        check_sizes([item], settings.max_items, settings.max_string_chars)
        metrics.items.labels("gsm8k").inc()
        return score_seed_item(item)

    @app.post("/batch_reward", response_model=SeedBatchResult, tags=["seed-compatible"])
    def seed_batch_reward(batch: SeedBatchRequest, _=Depends(require_ready)) -> SeedBatchResult:
        check_sizes(batch.items, settings.max_items, settings.max_string_chars)
        rewards = [score_seed_item(item) for item in batch.items]
        metrics.items.labels("gsm8k").inc(len(rewards))
        accuracy = sum(r.correct for r in rewards) / len(rewards) if rewards else 0.0
        return SeedBatchResult(rewards=rewards, accuracy=accuracy)

    def score_seed_item(item: SeedRewardRequest) -> SeedRewardResult:
        result, rule = gsm8k.score_seed(item.response, item.ground_truth)
        details = rule if result.extracted is not None else "no number found in the response"
        return SeedRewardResult(
            reward=result.score, correct=result.correct, extracted_answer=result.extracted, details=details
        )

    return app
