"""Pure-ASGI middleware (no BaseHTTPMiddleware: it costs a task per request on the hot path).

- `ObservabilityMiddleware`: Prometheus request count / latency / errors per route, one log line per request.
- `BodyLimitMiddleware`: 413 for bodies over the limit, whether or not Content-Length is sent.
- `BearerAuthMiddleware`: 401 unless `Authorization: Bearer <token>`, except on open paths.
- `ShutdownGuardMiddleware`: a request still running when the SIGTERM drain runs out gets a JSON 503
  (uvicorn would send a plain-text 500).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger("services.access")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


async def send_json(send, status: int, payload: dict, headers: tuple = ()) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ServiceMetrics:
    """The Prometheus registry of one app; services add their own metrics to `registry`."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        prefix = service.replace("-", "_")
        self.requests = Counter(
            f"{prefix}_requests_total", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            f"{prefix}_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            f"{prefix}_errors_total",
            "HTTP responses with status >= 400",
            ["route", "status"],
            registry=self.registry,
        )


class ObservabilityMiddleware:
    def __init__(self, app, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            # The route template (e.g. /v1/batches), not the raw path, so labels stay bounded.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(elapsed)
            if status >= 400:
                self.metrics.errors.labels(route, str(status)).inc()
            if route not in ("/health", "/metrics"):
                log.info(
                    "request",
                    extra={
                        "method": method,
                        "path": scope["path"],
                        "status": status,
                        "ms": round(elapsed * 1e3, 2),
                    },
                )


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = {"error": f"request body larger than the limit of {self.max_bytes} bytes"}
        # Closing the connection after a refusal stops the upload there; on a kept-alive connection the
        # server would have to receive (and throw away) the rest of an oversized body.
        close = ((b"connection", b"close"),)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await send_json(send, 400, {"error": "invalid Content-Length header"}, close)
                if declared > self.max_bytes:
                    return await send_json(send, 413, too_large, close)
        # Read the body ourselves so a chunked upload cannot slip past the limit, then replay it.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await send_json(send, 413, too_large, close)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class BearerAuthMiddleware:
    # The API's description is no secret, and schema-driven clients need it to find the routes.
    OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")

    def __init__(self, app, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await send_json(
                send,
                401,
                {"error": "missing or invalid bearer token (Authorization header)"},
                headers=((b"www-authenticate", b'Bearer realm="rl-jobgroup"'),),
            )
        return await self.app(scope, receive, send)


class ShutdownGuardMiddleware:
    """uvicorn cancels requests still running when the graceful-shutdown time is up, and answers them
    with a plain-text 500. Here such a request gets a JSON 503 naming the cause, so a client retries
    it elsewhere instead of treating it as a server bug."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if started:
                raise
            await send_json(
                send,
                503,
                {"error": "the server is shutting down and could not finish this request; retry it"},
                headers=((b"retry-after", b"1"), (b"connection", b"close")),
            )
