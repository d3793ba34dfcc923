"""Micro-batching: concurrent requests share one embed + one search, off the event loop.

Requests wait in a queue. The batching task takes the first, waits at most `max_wait_s` for more
(or until `max_batch` queries are queued), and hands the lot to one worker thread. While that
thread computes, new requests queue up, so under load the next batch is already full and goes at
once: the batch size grows with the load instead of the latency. One worker thread, because torch
and FAISS already use every core they are given, and two batches at once would only contend.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

Job = TypeVar("Job")
Result = TypeVar("Result")

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class BatchMetrics:
    """Batch sizes and timings on /metrics: the evidence that batching happens."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.batch_requests = Histogram(
            f"{prefix}_batch_requests",
            "Requests served by one embed + search call",
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
            "Time from arrival to the start of its batch",
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


@dataclass
class _Pending(Generic[Job]):
    job: Job
    size: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


class MicroBatcher(Generic[Job, Result]):
    """`await submit(job)` -> its result; `process(jobs)` runs on the worker thread, one batch at a time."""

    def __init__(
        self,
        process: Callable[[list[Job]], list[Result]],
        size_of: Callable[[Job], int],
        max_batch: int,
        max_wait_s: float,
        metrics: BatchMetrics | None = None,
        worker_init: Callable[[], None] | None = None,
    ) -> None:
        self.process = process
        self.size_of = size_of
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self._pending: collections.deque[_Pending[Job]] = collections.deque()
        self._queued = 0
        self._arrived: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # OpenMP thread counts can be per-thread settings, so the worker sets its own (worker_init).
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="retrieval-batch", initializer=worker_init
        )

    async def submit(self, job: Job) -> Result:
        if self._task is None:  # created lazily: it must live on the server's event loop
            self._arrived, self._full = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        pending = _Pending(job, self.size_of(job), asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        self._queued += pending.size
        self._arrived.set()
        if self._queued >= self.max_batch:
            self._full.set()
        return await pending.future

    async def _next_batch(self) -> list[_Pending[Job]]:
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        if self._queued < self.max_batch and self.max_wait_s > 0:
            self._full.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.max_wait_s)
        batch, size = [], 0
        # A job larger than max_batch still goes, alone; otherwise stop before overfilling.
        while self._pending and (not batch or size + self._pending[0].size <= self.max_batch):
            item = self._pending.popleft()
            batch.append(item)
            size += item.size
        self._queued -= size
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            batch = [p for p in batch if not p.future.done()]  # callers that gave up (disconnects)
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._worker, self.process, [p.job for p in batch])
            except Exception as exc:  # noqa: BLE001 - the callers get the error, the loop keeps serving
                if self.metrics:
                    self.metrics.failures.inc()
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self._observe(batch, started)
            for p, result in zip(batch, results):
                if not p.future.done():
                    p.future.set_result(result)

    def _observe(self, batch: list[_Pending[Job]], started: float) -> None:
        if self.metrics is None:
            return
        self.metrics.batch_requests.observe(len(batch))
        self.metrics.batch_queries.observe(sum(p.size for p in batch))
        self.metrics.compute_seconds.observe(time.perf_counter() - started)
        for p in batch:
            self.metrics.queue_seconds.observe(started - p.arrived)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)
