"""reward-server: a thin HTTP layer over the scoring library (services.scoring.LocalScorer).

`POST /v1/rewards` is the hot path (a trainer sends thousands of items a step), so it reads its body
itself: orjson, a count of the items, then one TypedDict validation for the whole batch, then JSON
bytes out; no pydantic model per item (schemas.py says why). A body over PARSE_INLINE_BYTES is parsed
and checked in a thread (one at a time), so a 50 MB upload never stalls other clients or /health.
Scoring never runs on the event loop either (services.scoring), and a request whose client went away
is cancelled with the pool work it queued. Every other route is ordinary FastAPI.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, require_ready, unless_disconnected
from services.common.errors import ApiError, body_errors, load_json
from services.reward_server.body import TooManyItems, load_rewards_body
from services.common.settings import ServiceSettings
from services.reward_server.schemas import (
    REWARDS_REQUEST,
    Limits,
    OpenRLHFRewardRequest,
    OpenRLHFRewardResponse,
    RewardsRequest,
    RewardsResponse,
    ScorerInfo,
    ScorersResponse,
    SeedBatchRequest,
    SeedBatchResult,
    SeedRewardRequest,
    SeedRewardResult,
    SeedStats,
)
from services.scoring import DEFAULT_OPTIONS, SCORER_DOCS, LocalScorer, Scored, ScorerSettings, gsm8k

log = logging.getLogger("services.reward_server")

PARSE_INLINE_BYTES = 256 * 1024  # ~1 ms of orjson; larger bodies are read item by item, in a thread
LIMIT_RESPONSES = {413: {"description": "Over a size limit."}}
CHECKED_FIELDS = ("response", "prompt", "ground_truth", "data_source")  # held to max_string_chars


class RewardServerSettings(ScorerSettings, ServiceSettings):
    """reward-server: gsm8k, math, QA, code, reward-model and LLM-judge scoring (env REWARD_SERVER_...)."""

    model_config = SettingsConfigDict(env_prefix="REWARD_SERVER_", extra="forbid")

    port: int = Field(8001, ge=0, le=65535, description="TCP port to bind.")
    max_request_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    max_items: int = Field(16384, ge=1, description="Most items in one request; more get 413.")
    max_string_chars: int = Field(
        262144, ge=1, description="Longest response / prompt / ground_truth string; longer ones get 413."
    )
    openrlhf_data_source: str = Field(
        "openai/gsm8k", description="The scorer's data_source for a /get_reward body that names none."
    )


def parse_body(body: bytes, adapter: TypeAdapter, max_items: int | None = None):
    """JSON bytes -> validated data, or the 422 FastAPI would give (fields named as the caller wrote them).

    With `max_items`, a body whose `items` list is longer gets its 413 before any item is validated;
    a body over PARSE_INLINE_BYTES is read item by item (services.reward_server.body), stopping at
    max_items + 1.
    """
    if max_items is None or len(body) <= PARSE_INLINE_BYTES:
        data = load_json(body)
    else:
        try:
            data = load_rewards_body(body, max_items)
        except TooManyItems:
            raise ApiError(
                413, f"items: more than the limit of {max_items} per request; split the batch"
            ) from None
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError and the scanner's own
            error = {
                "type": "json_invalid",
                "loc": ("body",),
                "msg": "JSON decode error",
                "ctx": {"error": str(exc)},
            }
            raise RequestValidationError([error]) from None
    if max_items is not None and isinstance(data, dict) and isinstance(data.get("items"), list):
        check_count(len(data["items"]), max_items)
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise body_errors(exc) from None


def check_count(count: int, max_items: int) -> None:
    if count > max_items:
        raise ApiError(
            413, f"items: {count} items, more than the limit of {max_items} per request; split the batch"
        )


def check_sizes(items: list, max_items: int, max_chars: int) -> None:
    """413 naming the first thing over a limit: the item count, or one item's string field."""
    check_count(len(items), max_items)
    for index, item in enumerate(items):
        for field in CHECKED_FIELDS:
            value = item.get(field) if isinstance(item, dict) else getattr(item, field, None)
            if not isinstance(value, str):
                continue
            if len(value) > max_chars:
                raise ApiError(
                    413, f"items.{index}.{field}: {len(value)} characters, more than the limit of {max_chars}"
                )
            if not value.isascii() and not encodable(value):
                raise ApiError(
                    422, f"invalid request: items.{index}.{field}: not valid Unicode (lone surrogate)"
                )


def encodable(text: str) -> bool:
    """False for text with a lone surrogate ("\\ud800"): it cannot be written back as UTF-8 JSON."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_batch(body: bytes, settings: RewardServerSettings) -> dict:
    """Parse, count, validate and size-check a /v1/rewards body (called on or off the event loop)."""
    parsed = parse_body(body, REWARDS_REQUEST, settings.max_items)
    check_sizes(parsed["items"], settings.max_items, settings.max_string_chars)
    return parsed


def encode_results(scored: list[Scored]) -> bytes:
    return orjson.dumps(
        {
            "results": [
                {"score": s.score, "correct": s.correct, "extracted": s.extracted, "error": s.error}
                for s in scored
            ],
            "deadline_exceeded": any(s.late for s in scored),
        }
    )


def document_body(app: FastAPI, path: str, model: type[BaseModel], finish=lambda schema: schema) -> None:
    """Put `model` in the OpenAPI doc as the body of `path`, whose route reads the body itself;
    `finish(schema)` then adds what only the settings know (limits)."""
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
        return finish(schema)

    app.openapi = openapi


class ScoringMetrics:
    """Items scored and failed per scorer, requests past their deadline, and the math pool's counters."""

    def __init__(self, registry, app: FastAPI) -> None:
        self.items = Counter("reward_server_items_total", "Items scored", ["scorer"], registry=registry)
        self.errors = Counter(
            "reward_server_item_errors_total", "Items that got an error", ["scorer"], registry=registry
        )
        self.past_deadline = Counter(
            "reward_server_requests_past_deadline_total",
            "Requests that hit their deadline",
            registry=registry,
        )
        self.app = app
        for attribute, name, text in (
            ("timeouts", "reward_server_math_timeouts", "Math items killed at the deadline"),
            ("crashes", "reward_server_math_crashes", "Math workers that died"),
            ("abandoned", "reward_server_math_cancelled", "Math items dropped because their request ended"),
            ("queued", "reward_server_math_queued", "Math items waiting for a worker"),
        ):
            Gauge(name, text, registry=registry).set_function(lambda a=attribute: self.pool_count(a))

    def pool_count(self, attribute: str) -> int:
        pool = getattr(getattr(self.app.state, "scorer", None), "math_pool", None)
        return int(getattr(pool, attribute, 0))

    def count(self, scored: list[Scored]) -> None:
        outcomes = collections.Counter((s.scorer, s.error is not None) for s in scored)
        for (scorer, failed), n in outcomes.items():
            self.items.labels(scorer).inc(n)
            if failed:
                self.errors.labels(scorer).inc(n)
        if any(s.late for s in scored):
            self.past_deadline.inc()

    def stats(self, scorer: LocalScorer) -> SeedStats:
        def total(counter: Counter) -> int:
            return int(
                sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
            )

        model = scorer.reward_model is not None
        return SeedStats(
            type="rule-based+model" if model else "rule-based",
            supported_tasks=[name for name in SCORER_DOCS if scorer.available(name)],
            items_scored=total(self.items),
            item_errors=total(self.errors),
            requests_past_deadline=total(self.past_deadline),
            math_timeouts=self.pool_count("timeouts"),
            math_worker_crashes=self.pool_count("crashes"),
            cancelled_math_items=self.pool_count("abandoned"),
        )


def string_limits(schema: dict, settings: RewardServerSettings) -> dict:
    """Put the runtime size limits into the OpenAPI document: items per request, characters per string."""
    components = schema["components"]["schemas"]
    for name in ("RewardsRequest", "SeedBatchRequest"):
        components[name]["properties"]["items"]["maxItems"] = settings.max_items
    for name, fields in (("RewardItem", CHECKED_FIELDS), ("SeedRewardRequest", CHECKED_FIELDS)):
        for field in fields:
            spec = components[name]["properties"].get(field, {})
            for branch in [spec, *spec.get("anyOf", [])]:
                if branch.get("type") == "string":
                    branch["maxLength"] = settings.max_string_chars
    return schema


def create_app(settings: RewardServerSettings | None = None, scorer: LocalScorer | None = None) -> FastAPI:
    settings = settings or RewardServerSettings()

    def load(app: FastAPI) -> None:
        app.state.scorer = scorer or LocalScorer(settings)
        app.state.health_info = health_info(app.state.scorer)

    def close(app: FastAPI) -> None:
        if scorer is None:  # only what load() made; a scorer passed in belongs to the caller
            app.state.scorer.close()

    app = create_service_app("reward-server", settings, load=load, close=close, description=__doc__ or "")
    metrics = ScoringMetrics(app.state.metrics.registry, app)

    async def get_scorer(state=Depends(require_ready)) -> LocalScorer:
        return state.scorer

    big_parses = asyncio.Semaphore(1)  # bounds the memory of large uploads being parsed at once

    @app.post("/v1/rewards", response_model=RewardsResponse, tags=["rewards"], responses=LIMIT_RESPONSES)
    async def rewards(request: Request, scorer: LocalScorer = Depends(get_scorer)) -> Response:
        """Score a batch; an item that cannot be scored gets `error` and score 0, the rest are unaffected."""
        parsed = await read_request(request, settings, big_parses)
        scored = await unless_disconnected(
            request, scorer.score_items(parsed["items"], parsed.get("options"))
        )
        if isinstance(scored, Response):  # the client went away; its work was cancelled
            return scored
        metrics.count(scored)
        return Response(encode_results(scored), media_type="application/json")

    document_body(app, "/v1/rewards", RewardsRequest, lambda schema: string_limits(schema, settings))

    @app.get("/v1/scorers", response_model=ScorersResponse, tags=["rewards"])
    def scorers(scorer: LocalScorer = Depends(get_scorer)) -> ScorersResponse:
        return describe_scorers(scorer, settings)

    @app.get("/stats", response_model=SeedStats, tags=["seed-compatible"])
    def stats(scorer: LocalScorer = Depends(get_scorer)) -> SeedStats:
        """The SkyPilot job-group example's route: what this server scores, and its counters."""
        return metrics.stats(scorer)

    @app.post("/reward", response_model=SeedRewardResult, tags=["seed-compatible"], responses=LIMIT_RESPONSES)
    def seed_reward(item: SeedRewardRequest, _=Depends(require_ready)) -> SeedRewardResult:
        """The seed example's route. Items carry no data_source: gsm8k strict, else the last number."""
        check_sizes([item], settings.max_items, settings.max_string_chars)
        metrics.items.labels("gsm8k").inc()
        return score_seed_item(item)

    @app.post(
        "/batch_reward", response_model=SeedBatchResult, tags=["seed-compatible"], responses=LIMIT_RESPONSES
    )
    def seed_batch_reward(batch: SeedBatchRequest, _=Depends(require_ready)) -> SeedBatchResult:
        check_sizes(batch.items, settings.max_items, settings.max_string_chars)
        metrics.items.labels("gsm8k").inc(len(batch.items))
        return score_seed_batch(batch)

    @app.post(
        "/get_reward",
        response_model=OpenRLHFRewardResponse,
        tags=["openrlhf-compatible"],
        responses={
            **LIMIT_RESPONSES,
            409: {"description": "prompts, labels or datasources differ from query in length."},
        },
    )
    async def get_reward(body: OpenRLHFRewardRequest, scorer: LocalScorer = Depends(get_scorer)) -> dict:
        """OpenRLHF's remote reward model protocol (`--remote_rm_url http://host:8001/get_reward`)."""
        items = openrlhf_items(body, settings.openrlhf_data_source)
        check_sizes(items, settings.max_items, settings.max_string_chars)
        scored = await scorer.score_items(items)
        metrics.count(scored)
        rewards = [s.score for s in scored]
        return {
            "rewards": rewards,
            "scores": rewards,
            "extra_logs": {"correct": [float(s.correct) for s in scored]},
        }

    return app


async def read_request(
    request: Request, settings: RewardServerSettings, big_parses: asyncio.Semaphore
) -> dict:
    """The validated /v1/rewards body; a large one is read in a thread, one at a time (memory)."""
    body = await request.body()
    if len(body) <= PARSE_INLINE_BYTES:
        return read_batch(body, settings)
    async with big_parses:
        return await asyncio.to_thread(read_batch, body, settings)


def openrlhf_items(body: OpenRLHFRewardRequest, default_source: str) -> list[dict]:
    """/get_reward's lists -> /v1/rewards items; 409 naming a list whose length differs from query's."""
    count = len(body.query)
    for name in ("prompts", "labels", "datasources"):
        values = getattr(body, name)
        if values is not None and len(values) != count:
            raise ApiError(409, f"invalid request: {name}: {len(values)} entries for {count} queries")
    prompts = body.prompts or [""] * count
    sources = body.datasources or [default_source] * count
    return [
        {
            "data_source": source,
            "response": query[len(prompt) :] if prompt and query.startswith(prompt) else query,
            "ground_truth": label,
            "prompt": prompt,
        }
        for query, prompt, label, source in zip(body.query, prompts, body.labels, sources)
    ]


def health_info(scorer: LocalScorer) -> dict:
    return {
        "scorers": [name for name in SCORER_DOCS if scorer.available(name)],
        "math_workers": scorer.settings.math_workers,
        "reward_model": scorer.settings.reward_model,
    }


def score_seed_batch(batch: SeedBatchRequest) -> SeedBatchResult:
    rewards = [score_seed_item(item) for item in batch.items]
    accuracy = sum(r.correct for r in rewards) / len(rewards) if rewards else 0.0
    return SeedBatchResult(rewards=rewards, accuracy=accuracy)


def score_seed_item(item: SeedRewardRequest) -> SeedRewardResult:
    result, rule = gsm8k.score_seed(item.response, item.ground_truth)
    details = rule if result.extracted is not None else "no number found in the response"
    return SeedRewardResult(
        reward=result.score, correct=result.correct, extracted_answer=result.extracted, details=details
    )


def describe_scorers(scorer: LocalScorer, settings: RewardServerSettings) -> ScorersResponse:
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
            request_deadline_s=scorer.settings.request_deadline_s,
        ),
    )
