"""retrieval-server: settings and routes. Search lives in core.py, fair micro-batching in batcher.py.

`POST /retrieve` is the hot path (a trainer's agents send one query per tool call, hundreds at once),
so it reads its body itself: orjson (which refuses lone surrogates and other text a tokenizer would
choke on, as a 422), a count of the queries (413 before anything is validated), then one pydantic
validation. The OpenAPI document describes the body with RetrieveRequest and this server's limits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, require_ready, unless_disconnected
from services.common.errors import ApiError, body_errors, load_json
from services.common.settings import ServiceSettings
from services.retrieval_server.batcher import BatchMetrics, FairBatcher, Slice
from services.retrieval_server.core import Retriever, SearchJob, load_retriever, response_body
from services.retrieval_server.schemas import RetrieveRequest, RetrieveResponse

log = logging.getLogger("services.retrieval_server")


class RetrievalServerSettings(ServiceSettings):
    """retrieval-server: Search-R1 /retrieve over an index folder (env prefix RETRIEVAL_SERVER_)."""

    model_config = SettingsConfigDict(env_prefix="RETRIEVAL_SERVER_", extra="forbid")

    port: int = Field(8002, ge=0, le=65535, description="TCP port to bind.")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    index: Path | None = Field(
        None, description="Index folder written by `python -m services.retrieval_server build`."
    )
    embedder: str | None = Field(
        None,
        description="Query embedder (hub id or folder); unset: the one in the index's manifest. "
        "A different model than the index was built with is refused.",
    )
    query_prefix: str | None = Field(None, description="Prepended to each query; unset: the manifest's.")
    query_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Query embedding precision; auto: bfloat16 on CPUs with AMX/AVX512-BF16, else float32.",
    )
    device: str = Field("cpu", description="torch device of the embedder, e.g. cpu or cuda.")
    threads: int | None = Field(
        None, ge=1, description="torch/FAISS threads; unset: all cores but one (kept for the event loop)."
    )
    default_topk: int = Field(3, ge=1, description="topk when a request omits it (Search-R1's default is 3).")
    max_topk: int = Field(100, ge=1, description="Largest topk a request may ask for (422 above).")
    max_queries: int = Field(1024, ge=1, description="Most queries in one request (413 above).")
    max_query_chars: int = Field(
        4096,
        ge=1,
        description="Longer queries are cut to this many characters before embedding (the embedder reads "
        "at most its max_seq_length tokens anyway; this bounds the tokenizer's work on runaway text).",
    )
    max_batch_queries: int = Field(
        256, ge=1, description="Most queries embedded together in one micro-batch."
    )
    max_batch_tokens: int = Field(
        1024,
        ge=1,
        description="Most estimated tokens (characters / 4, at most the embedder's window per query) in "
        "one micro-batch. Bounds how long a batch keeps everyone waiting: a request of long queries is "
        "served a slice per batch, interleaved with other requests.",
    )
    saturated_after_s: float = Field(
        2.0,
        gt=0,
        description="/health answers 503 'saturated' while a request has waited this long for its first "
        "micro-batch, so a load balancer can send new work elsewhere.",
    )
    max_wait_ms: float = Field(
        5.0,
        ge=0,
        description="How long a micro-batch waits for more requests before it runs (bounds the "
        "latency it adds; long enough for clients answered by the last batch to send their next query).",
    )
    ef_search: int | None = Field(None, ge=1, description="HNSW search depth; unset: the manifest's.")
    nprobe: int | None = Field(None, ge=1, description="IVF lists searched per query; unset: the manifest's.")

    @model_validator(mode="after")
    def _default_within_limit(self) -> RetrievalServerSettings:
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk {self.default_topk} is above max_topk {self.max_topk}")
        return self


DENSE_KINDS = ("flat", "hnsw", "ivfpq")
# settings that only some index kinds read: BM25 embeds nothing, and each FAISS kind has its own knob
INDEX_KIND_SETTINGS = {
    "embedder": DENSE_KINDS,
    "query_prefix": DENSE_KINDS,
    "query_precision": DENSE_KINDS,
    "device": DENSE_KINDS,
    "threads": DENSE_KINDS,
    "ef_search": ("hnsw",),
    "nprobe": ("ivfpq",),
}


def inert_settings(settings: RetrievalServerSettings, index_type: str) -> list[str]:
    """The settings given a value (not their default) that an index of this kind never reads."""
    return [
        name
        for name, kinds in INDEX_KIND_SETTINGS.items()
        if index_type not in kinds and getattr(settings, name) != type(settings).model_fields[name].default
    ]


def parse_request(body: bytes, settings: RetrievalServerSettings) -> SearchJob:
    """A /retrieve body -> a job within the limits, or the 4xx naming the problem."""
    data = load_json(body)
    if isinstance(data, dict) and isinstance(data.get("queries"), list):
        count, limit = len(data["queries"]), settings.max_queries
        if count > limit:
            raise ApiError(413, f"queries: {count} queries in one request; the limit is {limit}")
    try:
        request = RetrieveRequest.model_validate(data)
    except ValidationError as exc:
        raise body_errors(exc) from None
    topk = settings.default_topk if request.topk is None else request.topk
    if not 1 <= topk <= settings.max_topk:
        raise ApiError(422, f"invalid request: topk: must be between 1 and {settings.max_topk}, got {topk}")
    queries = [q[: settings.max_query_chars] for q in request.queries]
    return SearchJob(queries=queries, topk=topk, return_scores=request.return_scores)


def document_limits(app: FastAPI, settings: RetrievalServerSettings) -> None:
    """The /retrieve body in the OpenAPI document, with this server's limits as constraints."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base_openapi()
            definition = RetrieveRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            definition["properties"]["queries"]["maxItems"] = settings.max_queries
            definition["properties"]["topk"].update(minimum=1, maximum=settings.max_topk)
            schema["components"]["schemas"]["RetrieveRequest"] = definition
            schema["paths"]["/retrieve"]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RetrieveRequest"}}},
            }
        return app.openapi_schema

    app.openapi = openapi


def load_state(app: FastAPI, settings: RetrievalServerSettings) -> None:
    """Open the index, warm it up, and start the batcher (runs in a thread while /health says loading)."""
    from services.retrieval_server.embedder import default_threads, set_threads

    if settings.index is None:
        raise ValueError("no index folder given (--index DIR or RETRIEVAL_SERVER_INDEX)")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs every SIMD variant it tries
    threads = settings.threads or default_threads()
    retriever = load_retriever(
        settings.index,
        settings.embedder,
        query_prefix=settings.query_prefix,
        precision=settings.query_precision,
        device=settings.device,
        ef_search=settings.ef_search,
        nprobe=settings.nprobe,
        threads=threads,
    )
    # bm25s logs one INFO line per empty query (a query of stopwords): thousands per request. Its import
    # (inside load_retriever) sets its logger to DEBUG, so this must come after.
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    dense = retriever.manifest.embedder is not None
    inert = inert_settings(settings, retriever.manifest.index_type)
    if inert:
        flags = ", ".join("--" + name.replace("_", "-") for name in inert)
        log.warning(f"{flags}: no effect on a {retriever.manifest.index_type} index; ignored")
    warm_up = SearchJob(["warm-up query"], 1, True)
    retriever.answer([Slice(warm_up.queries, warm_up.options)])  # first-call costs before /health is ok
    metrics = BatchMetrics(app.state.metrics.registry, "retrieval_server")
    app.state.retriever = retriever
    app.state.batcher = FairBatcher(
        retriever.answer,
        max_queries=settings.max_batch_queries,
        max_cost=settings.max_batch_tokens,
        max_wait_s=settings.max_wait_ms / 1000,
        saturated_after_s=settings.saturated_after_s,
        metrics=metrics,
        worker_init=(lambda: set_threads(threads)) if dense else None,
    )
    app.state.saturation = app.state.batcher.saturation
    manifest = retriever.manifest
    app.state.health_info = {
        "index": manifest.index_type,
        "passages": manifest.count,
        "embedder": manifest.embedder.name if manifest.embedder else None,
        "dimension": manifest.embedder.dimension if manifest.embedder else None,
    }


def create_app(settings: RetrievalServerSettings | None = None) -> FastAPI:
    settings = settings or RetrievalServerSettings()

    def load(app: FastAPI) -> None:
        load_state(app, settings)

    def close(app: FastAPI) -> None:
        app.state.batcher.close()
        app.state.retriever.close()

    app = create_service_app("retrieval-server", settings, load=load, close=close, description=__doc__ or "")

    @app.post(
        "/retrieve",
        response_model=RetrieveResponse,
        tags=["retrieval"],
        responses={413: {"description": "Too many queries."}},
    )
    async def retrieve(request: Request, state=Depends(require_ready)) -> Response:
        """Search-R1 / verl SearchTool protocol: per query, the topk passages (with scores if asked)."""
        job = parse_request(await request.body(), settings)
        retriever: Retriever = state.retriever
        costs = [retriever.query_cost(q) for q in job.queries]
        hits = await unless_disconnected(request, state.batcher.submit(job.queries, costs, job.options))
        if isinstance(hits, Response):  # the client went away; its queued queries were dropped
            return hits
        return Response(response_body(hits), media_type="application/json")

    document_limits(app, settings)
    return app
