"""Fair micro-batching: concurrent requests share one embed + one search, off the event loop, and no
request, however large, holds back another.

Each request is a list of queries with an estimated cost each (tokens the embedder will read). The
batching task waits at most `max_wait_s` for work to gather (or until a batch's worth is queued),
then plans one micro-batch: one query from each waiting request in turn, round after round, until
the batch holds `max_queries` queries or `max_cost` of estimated work (the first query always fits,
so a lone long query still runs). A request of 1,000 long queries is thus served a slice per batch,
interleaved with everyone else's queries, and a one-query request waits for at most the batch in
flight plus its own, instead of behind the whole large request. Requests served in a batch go to
the back of the line for the next one.

The batch runs on one worker thread (torch and FAISS already use every core they are given; two
batches at once would only contend). If it raises, each of its slices is run again alone, so only
the request whose queries break the embedder fails; the others are answered. A caller that stops
waiting (its client disconnected) has its unscheduled queries dropped.

`saturation()` says when the server is too busy to take more work: a request has waited longer than
`saturated_after_s` for its first slice. /health turns that into 503 "saturated".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class BatchMetrics:
    """Batch sizes and timings on /metrics: the evidence that batching happens."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.batch_requests = Histogram(
            f"{prefix}_batch_requests",
            "Requests with a slice in one embed + search call",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_queries = Histogram(
            f"{prefix}_batch_queries",
            "Queries embedded by one embed call",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.queue_seconds = Histogram(
            f"{prefix}_queue_seconds",
            "Time from a request's arrival to the start of its first batch",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.compute_seconds = Histogram(
            f"{prefix}_batch_compute_seconds",
            "Worker time of one batch (embed, search, JSON)",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            f"{prefix}_batch_failures_total", "Batches whose compute raised", registry=registry
        )


@dataclass(frozen=True)
class Slice:
    """Consecutive queries of one request, with that request's options (e.g. topk)."""

    queries: Sequence[Any]
    options: Hashable


@dataclass(eq=False)
class _Request:
    queries: Sequence[Any]
    costs: Sequence[int]
    options: Hashable
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    scheduled: int = 0  # queries handed to batches so far
    answered: int = 0
    results: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.queries)


def plan_batch(pending: Sequence[tuple[Sequence[int], int]], max_queries: int, max_cost: int) -> list[int]:
    """How many queries of each request go into the next batch.

    `pending` holds, per request in turn order, its query costs and how many were already scheduled.
    Round-robin, one query per request per round, while the batch has room for it (count and cost);
    the very first query always fits.
    """
    taken = [0] * len(pending)
    count = cost = 0
    progressing = True
    while progressing and count < max_queries:
        progressing = False
        for index, (costs, done) in enumerate(pending):
            position = done + taken[index]
            if position >= len(costs) or (count and cost + costs[position] > max_cost):
                continue
            taken[index] += 1
            count += 1
            cost += costs[position]
            progressing = True
            if count == max_queries:
                break
    return taken


class FairBatcher:
    """`await submit(queries, costs, options)` -> one result per query. `process(slices)` runs on the
    worker thread, one batch at a time, and returns one list of per-query results per slice."""

    def __init__(
        self,
        process: Callable[[list[Slice]], list[list[Any]]],
        max_queries: int,
        max_cost: int,
        max_wait_s: float,
        saturated_after_s: float = 1.0,
        metrics: BatchMetrics | None = None,
        worker_init: Callable[[], None] | None = None,
    ) -> None:
        self.process = process
        self.max_queries = max_queries
        self.max_cost = max_cost
        self.max_wait_s = max_wait_s
        self.saturated_after_s = saturated_after_s
        self.metrics = metrics
        self._active: list[_Request] = []  # requests with queries not yet scheduled, in turn order
        self._queued_queries = 0
        self._queued_cost = 0
        self._arrived: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # OpenMP thread counts can be per-thread settings, so the worker sets its own (worker_init).
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="retrieval-batch", initializer=worker_init
        )

    async def submit(self, queries: Sequence[Any], costs: Sequence[int], options: Hashable) -> list[Any]:
        if self._task is None:  # created lazily: it must live on the server's event loop
            self._arrived, self._full = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        request = _Request(queries, costs, options, asyncio.get_running_loop().create_future())
        self._active.append(request)
        self._queued_queries += len(queries)
        self._queued_cost += sum(costs)
        self._arrived.set()
        if self._has_a_batch():
            self._full.set()
        return await request.future

    def saturation(self) -> str | None:
        """Why the server should not take more work now, or None."""
        now = time.perf_counter()
        waiting = [r for r in self._active if r.scheduled == 0 and not r.future.done()]
        if not waiting or now - waiting[0].arrived <= self.saturated_after_s:
            return None
        return (
            f"a request has waited {now - waiting[0].arrived:.1f}s for its first micro-batch "
            f"({self._queued_queries} queries queued)"
        )

    def _has_a_batch(self) -> bool:
        return self._queued_queries >= self.max_queries or self._queued_cost >= self.max_cost

    async def _gather(self) -> None:
        """Wait for work, then up to max_wait_s for a full batch's worth."""
        while not self._active:
            self._arrived.clear()
            await self._arrived.wait()
        if not self._has_a_batch() and self.max_wait_s > 0:
            self._full.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.max_wait_s)

    def _drop_abandoned(self) -> None:
        for request in self._active:
            if request.future.done():  # the caller gave up (disconnect): forget its remaining queries
                self._queued_queries -= len(request.queries) - request.scheduled
                self._queued_cost -= sum(request.costs[request.scheduled :])
        self._active = [r for r in self._active if not r.future.done()]

    def _plan(self) -> list[tuple[_Request, int, int]]:
        """Take the next batch's slices off the queue; served requests go to the back of the line."""
        self._drop_abandoned()
        counts = plan_batch([(r.costs, r.scheduled) for r in self._active], self.max_queries, self.max_cost)
        plan, served, waiting, now = [], [], [], time.perf_counter()
        for request, count in zip(self._active, counts):
            if not count:
                waiting.append(request)
                continue
            start, stop = request.scheduled, request.scheduled + count
            if start == 0 and self.metrics:
                self.metrics.queue_seconds.observe(now - request.arrived)
            plan.append((request, start, stop))
            request.scheduled = stop
            self._queued_queries -= count
            self._queued_cost -= sum(request.costs[start:stop])
            if stop < len(request.queries):
                served.append(request)
        self._active = waiting + served
        return plan

    def _compute(self, slices: list[Slice]) -> list[list[Any] | BaseException]:
        """The batch on the worker thread; if it fails, each slice alone, so one bad request fails alone."""
        try:
            return self.process(slices)
        except Exception as exc:  # noqa: BLE001 - isolate, then hand each caller its own outcome
            if self.metrics:
                self.metrics.failures.inc()
            if len(slices) == 1:
                return [exc]
        outcomes: list[list[Any] | BaseException] = []
        for one in slices:
            try:
                outcomes.append(self.process([one])[0])
            except Exception as exc:  # noqa: BLE001
                outcomes.append(exc)
        return outcomes

    def _deliver(self, plan: list[tuple[_Request, int, int]], outcomes: list) -> None:
        for (request, start, stop), outcome in zip(plan, outcomes):
            if request.future.done():
                continue
            if isinstance(outcome, BaseException):
                request.future.set_exception(outcome)
                continue
            request.results[start:stop] = outcome
            request.answered += stop - start
            if request.answered == len(request.queries):
                request.future.set_result(request.results)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._gather()
            plan = self._plan()
            if not plan:
                continue
            slices = [Slice(r.queries[start:stop], r.options) for r, start, stop in plan]
            started = time.perf_counter()
            outcomes = await loop.run_in_executor(self._worker, self._compute, slices)
            if self.metrics:
                self.metrics.batch_requests.observe(len(plan))
                self.metrics.batch_queries.observe(sum(len(s.queries) for s in slices))
                self.metrics.compute_seconds.observe(time.perf_counter() - started)
            self._deliver(plan, outcomes)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for request in self._active:
            if not request.future.done():
                request.future.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)
