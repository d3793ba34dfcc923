"""The app factory every service builds on, and `serve()` that runs it under uvicorn.

A service supplies its settings, a `load(app)` that fills `app.state` with heavy resources (run in a
thread after the server is listening, so `/health` answers 503 "loading" meanwhile), and its routes.
If loading fails the process logs one line and exits non-zero instead of serving a half-ready app.
Once loaded, a service may set `app.state.saturation` to a function that returns why it is too busy
to take more work right now (or None): `/health` then answers 503 "saturated", so a load balancer
sends new work to another replica. The OpenAPI document names every status a route may answer and
the one error body they share (`services.common.errors.ErrorResponse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from services.common.errors import ApiError, document_errors, install_error_handlers
from services.common.logs import configure_logging
from services.common.middleware import (
    BearerAuthMiddleware,
    BodyLimitMiddleware,
    ObservabilityMiddleware,
    ServiceMetrics,
    ShutdownGuardMiddleware,
)
from services.common.settings import ServiceSettings

log = logging.getLogger("services.app")

Loader = Callable[[FastAPI], None]
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; only our metrics see it


class HealthResponse(BaseModel):
    """200 when ready; 503 while loading, after a failed load, or while saturated."""

    model_config = ConfigDict(extra="allow")

    status: str = Field(description="ok, loading, failed or saturated.")
    service: str
    error: str | None = Field(None, description="Why loading failed (status failed).")
    reason: str | None = Field(None, description="Why the service is saturated (status saturated).")


HEALTH_RESPONSES = {
    200: {"model": HealthResponse, "description": "Ready."},
    503: {"model": HealthResponse, "description": "Loading, failed to load, or saturated."},
}
METRICS_RESPONSES = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format."}
}


def create_service_app(
    name: str,
    settings: ServiceSettings,
    load: Loader | None = None,
    close: Loader | None = None,
    version: str = "0.1.0",
    description: str = "",
) -> FastAPI:
    """A FastAPI app with health, metrics, auth, size limits and JSON errors wired in."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_load_in_background(app, load))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            if close is not None and app.state.ready:
                close(app)

    app = FastAPI(title=name, version=version, description=description, lifespan=lifespan)
    app.state.service = name
    app.state.settings = settings
    app.state.ready = False
    app.state.load_error = None
    app.state.health_info = {}
    app.state.metrics = ServiceMetrics(name)
    app.state.saturation = None

    install_error_handlers(app)
    # Added innermost first: the shutdown guard and metrics see every response, auth runs before the
    # body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.auth_token:
        app.add_middleware(BearerAuthMiddleware, token=settings.auth_token)
    app.add_middleware(ObservabilityMiddleware, metrics=app.state.metrics)
    app.add_middleware(ShutdownGuardMiddleware)

    @app.get("/health", tags=["ops"], response_model=HealthResponse, responses=HEALTH_RESPONSES)
    async def health(request: Request) -> JSONResponse:
        body = health_body(request.app.state, name)
        status = 200 if body["status"] == "ok" else 503
        return JSONResponse({**body, "version": version} if status == 200 else body, status_code=status)

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=METRICS_RESPONSES)
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(base_openapi(), auth=bool(settings.auth_token))
        return app.openapi_schema

    app.openapi = openapi
    return app


def health_body(state, name: str) -> dict:
    """What /health says: failed or loading (503), saturated (503), or ok with the service's details."""
    if state.load_error is not None:
        return {"status": "failed", "service": name, "error": state.load_error}
    if not state.ready:
        return {"status": "loading", "service": name}
    busy = state.saturation() if state.saturation is not None else None
    if busy is not None:
        return {"status": "saturated", "service": name, "reason": busy}
    return {"status": "ok", "service": name, **state.health_info}


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (call it after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or a 499 once the client has gone: `work` is then cancelled, so a client that
    timed out (and may be retrying) leaves nothing running behind it."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not job.done()
        if gone:
            job.cancel()
    if gone:
        log.info("client disconnected; its work was cancelled", extra={"path": request.url.path})
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return job.result()


async def _load_in_background(app: FastAPI, load: Loader | None) -> None:
    try:
        if load is not None:
            await asyncio.to_thread(load, app)
            # what the load built (models, indexes, passages: millions of objects) lives until exit:
            # out of the collector's sight, so full collections under load do not walk it every time
            gc.collect()
            gc.freeze()
        app.state.ready = True
        log.info("ready", extra={"service": app.state.service})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any load failure ends the service the same way
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        log.error(f"{app.state.service} failed to load: {app.state.load_error}")
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True


def ready_state(request: Request) -> Any:
    """The app's loaded state, for routes that need it: 503 until the load finished."""
    if not request.app.state.ready:
        raise ApiError(503, f"{request.app.state.service} is still loading; poll GET /health")
    return request.app.state


async def require_ready(request: Request) -> Any:
    """`ready_state` as a dependency. async: FastAPI runs a plain `def` dependency in its thread pool,
    a thread hand-off per request on the hot path."""
    return ready_state(request)


class DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after draining, so the process would end "killed by signal 15";
    here a drained shutdown is a clean exit (code 0), which is what supervisors and launchers expect."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, settings: ServiceSettings, loop: Literal["auto", "asyncio"] = "auto") -> None:
    """Run under uvicorn; SIGTERM drains in-flight requests (graceful_shutdown_s) before exiting.
    `loop` is uvicorn's: "auto" takes uvloop where installed, "asyncio" the standard library's."""
    configure_logging(settings.log_level, settings.log_format)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        timeout_keep_alive=settings.keep_alive_s,
        lifespan="on",
        loop=loop,
    )
    server = DrainingServer(config)
    app.state.server = server
    server.run()
    if app.state.load_error is not None:
        sys.exit(1)
