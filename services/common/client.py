"""HTTP clients the trainer (and verl adapters) use to call our services.

One policy for every service:
- timeouts on every call; bounded retries with full-jitter exponential backoff on connection
  errors, timeouts, 429 and 5xx (the request bodies we send are idempotent: a batch by cursor,
  scoring, retrieval), then, with `deadline_s`, tries every few seconds until that long after the first
  failure (the trainer waits minutes for a service its job group restarts); every retry is logged
  with its URL, attempt and delay;
- a 4xx other than 429 is the caller's bug and raises at once with the server's message;
- several replicas (`urls=[...]`): requests round-robin over the healthy ones; a replica that fails
  is set aside for a cool-down that grows while it keeps failing, and comes back on its own;
- concurrent requests each get a keep-alive connection of their own (`max_connections` at once), and
  the next requests reuse them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("services.client")

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class ServiceError(RuntimeError):
    """A service answered with an error we should not retry, or stayed unreachable after retries."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(max, base * 2**attempt)] so retrying clients spread out."""
    return rng.uniform(0.0, min(max_s, base_s * (2**attempt)))


def normalize_urls(urls: str | Sequence[str]) -> list[str]:
    """Accept one URL, a comma-separated string, or a list; strip trailing slashes."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    cleaned = [u.strip().rstrip("/") for u in items if u and u.strip()]
    if not cleaned:
        raise ValueError("no service URL given")
    return cleaned


@dataclass
class _Replica:
    url: str
    failures: int = 0
    down_until: float = 0.0


@dataclass
class ReplicaSet:
    """Round-robin over replicas that are not cooling down after a failure."""

    urls: list[str]
    cooldown_s: float = 1.0
    max_cooldown_s: float = 30.0
    replicas: list[_Replica] = field(init=False)

    def __post_init__(self) -> None:
        self.replicas = [_Replica(u) for u in self.urls]
        self._turn = itertools.count()

    def pick(self) -> _Replica:
        now = time.monotonic()
        healthy = [r for r in self.replicas if r.down_until <= now]
        if healthy:
            return healthy[next(self._turn) % len(healthy)]
        # Everyone is cooling down: try the one that comes back first rather than failing outright.
        return min(self.replicas, key=lambda r: r.down_until)

    def mark_failed(self, replica: _Replica) -> None:
        replica.failures += 1
        replica.down_until = time.monotonic() + min(
            self.max_cooldown_s, self.cooldown_s * 2 ** (replica.failures - 1)
        )

    def mark_ok(self, replica: _Replica) -> None:
        replica.failures = 0
        replica.down_until = 0.0

    @property
    def healthy_urls(self) -> list[str]:
        now = time.monotonic()
        return [r.url for r in self.replicas if r.down_until <= now]


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])
    except ValueError:
        pass
    return response.text[:500]


def _judge(response: httpx.Response, where: str) -> tuple[bool, str]:
    """(succeeded, problem). Raises at once for a 4xx that retrying cannot fix."""
    if response.status_code < 400:
        return True, ""
    problem = f"{where}: HTTP {response.status_code}: {_error_message(response)}"
    if response.status_code not in RETRYABLE_STATUS:
        raise ServiceError(problem, response.status_code)
    return False, problem


class _Policy:
    """What both clients share: the replicas, the retry budget and the auth header."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        token: str | None = None,
        seed: int | None = None,
        deadline_s: float = 0.0,
    ) -> None:
        self.replicas = ReplicaSet(normalize_urls(urls))
        self.timeout_s = timeout_s
        self.retries = retries
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._rng = random.Random(seed)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _plan(self, path: str) -> Generator[str | float, httpx.Response | httpx.TransportError | None, Any]:
        """The retry policy, written once for both clients (sans I/O). It yields the URL to call next,
        and is sent back the response or the transport error; or it yields a delay in seconds to sleep
        before the next try. It returns the decoded JSON, or raises ServiceError.

        `retries` quick tries first (full jitter); then, until `deadline_s` after the first failure,
        tries every max_backoff_s/2 .. max_backoff_s: a service restarting takes tens of seconds."""
        last_problem, first_failure, attempt = "no attempt made", None, 0
        while True:
            replica = self.replicas.pick()
            outcome = yield replica.url + path
            if isinstance(outcome, httpx.Response):
                done, last_problem = _judge(outcome, replica.url + path)
                if done:
                    self.replicas.mark_ok(replica)
                    return outcome.json()
            else:  # connect refused, reset, timeouts
                last_problem = f"{replica.url}{path}: {type(outcome).__name__}: {outcome}"
            self.replicas.mark_failed(replica)
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            delay = self._delay(attempt, remaining_s=first_failure + self.deadline_s - now)
            if delay is None:
                break
            attempt += 1
            log.warning(
                "retrying %s in %.1f s (attempt %d failed: %s)",
                replica.url + path,
                delay,
                attempt,
                last_problem,
                extra={"url": replica.url + path, "attempt": attempt, "delay_s": round(delay, 3)},
            )
            yield delay
        waited = f" over {time.monotonic() - first_failure:.0f} s" if self.deadline_s else ""
        raise ServiceError(f"gave up after {attempt + 1} attempts{waited}: {last_problem}")

    def _delay(self, attempt: int, remaining_s: float) -> float | None:
        """Seconds to wait before the next try after `attempt` (0-based) failed; None: give up."""
        if attempt < self.retries:
            return backoff_delay(attempt, self.backoff_s, self.max_backoff_s, self._rng)
        if remaining_s <= 0:
            return None
        # past the quick tries: half jitter, so the tries keep coming and end at the deadline
        return min(remaining_s, self.max_backoff_s * self._rng.uniform(0.5, 1.0))


class _Lanes:
    """Connections for concurrent requests: a request takes a lane (an httpx client holding one
    keep-alive connection per replica), and gives it back when its response is read; at most `size`
    lanes are out at once, and the most recently returned is reused first.

    Not one httpx client with `size` connections: its pool (httpcore 1.0) walks every connection on
    each request's start and end, polling the socket of each idle one. 64 callers through one pool of
    64 connections cost this process 10-12 ms of CPU a request (~1 ms with a lane each), a whole core
    at 90 requests/s; on a machine it shares with the server, that CPU came out of the server's.
    """

    def __init__(self, size: int, replicas: int, timeout_s: float, headers: dict) -> None:
        self._slots = asyncio.Semaphore(size)
        self._free: list = []
        self._opened: list = []
        self._client_args = {
            "timeout": timeout_s,
            "headers": headers,
            "limits": httpx.Limits(max_connections=replicas, max_keepalive_connections=replicas),
            "verify": httpx.create_ssl_context(),  # one for all: ~45 ms of CPU to build each
        }

    @contextlib.asynccontextmanager
    async def lane(self):
        async with self._slots:
            http = self._free.pop() if self._free else self._open()
            try:
                yield http
            finally:
                self._free.append(http)

    def _open(self) -> httpx.AsyncClient:
        http = httpx.AsyncClient(**self._client_args)
        self._opened.append(http)
        return http

    async def aclose(self) -> None:
        await asyncio.gather(*(http.aclose() for http in self._opened))


class _ThreadLanes(_Lanes):
    """_Lanes for callers on threads (httpx.Client lanes). One shared httpx.Client kept 20 connections
    alive (httpx's default), so 44 of 64 threads reconnected each call, and walked the others' on each;
    the GIL spread that out (no collapse: bench/retrieval_server.py --client sync-service, BENCHMARKS.md),
    but lanes cost the 64 threads a fifth less CPU and give the server ~5% more requests a second."""

    def __init__(self, size: int, replicas: int, timeout_s: float, headers: dict) -> None:
        super().__init__(size, replicas, timeout_s, headers)
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lane(self):
        with self._slots:
            with self._lock:
                http = self._free.pop() if self._free else self._open()
            try:
                yield http
            finally:
                with self._lock:
                    self._free.append(http)

    def _open(self) -> httpx.Client:
        http = httpx.Client(**self._client_args)
        self._opened.append(http)
        return http

    def close(self) -> None:
        for http in self._opened:
            http.close()


class AsyncServiceClient(_Policy):
    """Async JSON client with retries and replica spreading. Use as `async with` or call `aclose()`."""

    def __init__(self, urls: str | Sequence[str], *, max_connections: int = 64, **policy) -> None:
        super().__init__(urls, **policy)
        self._lanes = _Lanes(max_connections, len(self.replicas.urls), self.timeout_s, self.headers)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._lanes.aclose()

    async def _send(self, method: str, url: str, **kwargs) -> httpx.Response:
        async with self._lanes.lane() as http:
            return await http.request(method, url, **kwargs)

    async def request(self, method: str, path: str, **kwargs) -> dict | list:
        plan = self._plan(path)
        step = next(plan)
        try:
            while True:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    step = plan.send(None)
                    continue
                try:
                    outcome = await self._send(method, step, **kwargs)
                except httpx.TransportError as exc:
                    outcome = exc
                step = plan.send(outcome)
        except StopIteration as finished:
            return finished.value

    async def get(self, path: str, **kwargs) -> dict | list:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, payload: dict, **kwargs) -> dict | list:
        return await self.request("POST", path, json=payload, **kwargs)

    async def wait_healthy(self, timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        """Wait until every replica answers /health with 200; ServiceError naming the laggards if not."""
        deadline = time.monotonic() + timeout_s
        pending = {r.url for r in self.replicas.replicas}
        last: dict[str, str] = {}
        while pending:
            for url in sorted(pending):
                try:
                    response = await self._send("GET", url + "/health", timeout=min(5.0, timeout_s))
                    if response.status_code == 200:
                        pending.discard(url)
                        continue
                    last[url] = f"HTTP {response.status_code}: {_error_message(response)}"
                except httpx.TransportError as exc:
                    last[url] = f"{type(exc).__name__}"
            if pending and time.monotonic() > deadline:
                detail = ", ".join(f"{u} ({last.get(u, 'no answer')})" for u in sorted(pending))
                raise ServiceError(f"not healthy within {timeout_s:.0f}s: {detail}")
            if pending:
                await asyncio.sleep(poll_s)


class SyncServiceClient(_Policy):
    """The same policy for synchronous callers (verl's reward hooks run outside an event loop), safe to
    share between threads: each call in flight holds a connection of its own, as the async client's do."""

    def __init__(self, urls: str | Sequence[str], *, max_connections: int = 64, **policy) -> None:
        super().__init__(urls, **policy)
        self._lanes = _ThreadLanes(max_connections, len(self.replicas.urls), self.timeout_s, self.headers)

    def close(self) -> None:
        self._lanes.close()

    def _send(self, method: str, url: str, **kwargs) -> httpx.Response:
        with self._lanes.lane() as http:
            return http.request(method, url, **kwargs)

    def request(self, method: str, path: str, **kwargs) -> dict | list:
        plan = self._plan(path)
        step = next(plan)
        try:
            while True:
                if isinstance(step, float):
                    time.sleep(step)
                    step = plan.send(None)
                    continue
                try:
                    outcome = self._send(method, step, **kwargs)
                except httpx.TransportError as exc:
                    outcome = exc
                step = plan.send(outcome)
        except StopIteration as finished:
            return finished.value

    def post(self, path: str, payload: dict, **kwargs) -> dict | list:
        return self.request("POST", path, json=payload, **kwargs)

    def get(self, path: str, **kwargs) -> dict | list:
        return self.request("GET", path, **kwargs)


class ServiceClient:
    """Base of each service's typed client: holds an AsyncServiceClient as `http`, closes it, waits on it."""

    def __init__(self, urls: str | Sequence[str], **policy) -> None:
        self.http = AsyncServiceClient(urls, **policy)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        await self.http.wait_healthy(timeout_s)
