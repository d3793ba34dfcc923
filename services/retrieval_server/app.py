"""retrieval-server: settings and routes. Search lives in core.py, batching in batcher.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.app import create_service_app, require_ready
from services.common.errors import ApiError
from services.common.settings import ServiceSettings
from services.retrieval_server.batcher import BatchMetrics, MicroBatcher
from services.retrieval_server.core import SearchJob, load_retriever
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


def check_request(request: RetrieveRequest, settings: RetrievalServerSettings) -> SearchJob:
    """Limits that depend on settings (the schema checks the shape)."""
    if len(request.queries) > settings.max_queries:
        raise ApiError(
            413,
            f"queries: {len(request.queries)} queries in one request; the limit is {settings.max_queries}",
        )
    topk = settings.default_topk if request.topk is None else request.topk
    if not 1 <= topk <= settings.max_topk:
        raise ApiError(422, f"invalid request: topk: must be between 1 and {settings.max_topk}, got {topk}")
    queries = [q[: settings.max_query_chars] for q in request.queries]
    return SearchJob(queries=queries, topk=topk, return_scores=request.return_scores)


def create_app(settings: RetrievalServerSettings | None = None) -> FastAPI:
    settings = settings or RetrievalServerSettings()

    def load(app: FastAPI) -> None:
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
        dense = retriever.manifest.embedder is not None
        retriever.answer([SearchJob(["warm-up query"], 1, True)])  # first-call costs before /health says ok
        metrics = BatchMetrics(app.state.metrics.registry, "retrieval_server")
        app.state.retriever = retriever
        app.state.batcher = MicroBatcher(
            retriever.answer,
            size_of=lambda job: len(job.queries),
            max_batch=settings.max_batch_queries,
            max_wait_s=settings.max_wait_ms / 1000,
            metrics=metrics,
            worker_init=(lambda: set_threads(threads)) if dense else None,
        )
        manifest = retriever.manifest
        app.state.health_info = {
            "index": manifest.index_type,
            "passages": manifest.count,
            "embedder": manifest.embedder.name if manifest.embedder else None,
            "dimension": manifest.embedder.dimension if manifest.embedder else None,
        }

    def close(app: FastAPI) -> None:
        app.state.batcher.close()
        app.state.retriever.close()

    app = create_service_app("retrieval-server", settings, load=load, close=close, description=__doc__ or "")

    def get_batcher(state=Depends(require_ready)) -> MicroBatcher:
        return state.batcher

    @app.post("/retrieve", response_model=RetrieveResponse, tags=["retrieval"])
    async def retrieve(request: RetrieveRequest, batcher: MicroBatcher = Depends(get_batcher)) -> Response:
        """Search-R1 / verl SearchTool protocol: per query, the topk passages (with scores if asked)."""
        body = await batcher.submit(check_request(request, settings))
        return Response(body, media_type="application/json")

    return app
