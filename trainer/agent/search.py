"""The search tool: verl's SearchTool against the retrieval-server, its queries batched.

SearchTool checks a call's arguments (`query_list`, as verl's SearchTool) and writes the response
text: verl's JSON (`{"result": "Doc 1 (Title: ...)\\n..."}`) in the hermes format, Search-R1's
passages in the search_r1 format.

SearchBatcher: the queries of every trajectory waiting for a search at a moment, in one /retrieve.

A trajectory that closes a search call hands its queries over and waits. A sender task, started
when a request slot is free, takes *everything* waiting when it runs and sends it as one request;
calls that arrive while requests are in flight wait for the next free slot and then go together. So
the batch grows with the load, with no timer and no wait when the trainer is quiet (the
retrieval-server batches concurrent requests again on its side).

A slow or failing server costs bounded time: the client retries connection errors, timeouts, 429 and
5xx with full-jitter exponential backoff (services.common.client), then every few seconds until
services.retry_deadline_s after the first failure; after the last attempt every call of that request
gets a SearchOutcome with the error, which the trajectory reads as its tool response (a failed result:
the loop's tool-failure policy applies). Nothing here raises into the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.retrieval_server.client import RetrievalClient, format_passages
from services.retrieval_server.schemas import Hit
from trainer.agent.formats import FormatName, ToolResult

log = logging.getLogger("trainer.agent")


@dataclass(frozen=True)
class SearchOutcome:
    """What one call's search gave: passages per query, or the error after the retries ran out."""

    hits: list[list[Hit]] | None = None
    error: str | None = None


@dataclass
class _Waiting:
    queries: tuple[str, ...]
    future: asyncio.Future


@dataclass
class SearchStats:
    """What the batcher did since the last `take_stats()`: the evidence that queries were batched."""

    requests: int = 0  # /retrieve requests sent
    queries: int = 0  # queries in them
    calls: int = 0  # tool calls served (a call may carry several queries)
    failed_calls: int = 0  # calls whose request failed after its retries
    errors: list[str] = field(default_factory=list)


class SearchBatcher:
    def __init__(
        self, client: RetrievalClient, *, topk: int, max_queries: int = 512, max_requests: int = 1
    ) -> None:
        """max_queries: most queries per /retrieve (the server refuses more than its --max-queries).
        max_requests: /retrieve requests in flight at once (one per retrieval replica is plenty)."""
        if topk < 1 or max_queries < 1 or max_requests < 1:
            raise ValueError("topk, max_queries and max_requests must be >= 1")
        self.client = client
        self.topk = topk
        self.max_queries = max_queries
        self.max_requests = max_requests
        self.stats = SearchStats()
        self._waiting: list[_Waiting] = []
        self._in_flight = 0
        self._sender_pending = False
        self._tasks: set[asyncio.Task] = set()

    async def search(self, queries: Sequence[str]) -> SearchOutcome:
        """Passages for each query (best first), or the error that stopped the request."""
        if not queries:
            raise ValueError("a search needs at least one query")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(tuple(queries), future))
        self._start_senders()
        return await future

    def take_stats(self) -> SearchStats:
        stats, self.stats = self.stats, SearchStats()
        return stats

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    # -------------------------------------------------------------------------------- internals

    def _start_senders(self) -> None:
        # A sender claims its slot now but picks its batch when it first runs: every call that arrives
        # before then (the other trajectories resumed in the same loop turn) joins it. One sender at a
        # time is pending, since it takes everything.
        if self._waiting and not self._sender_pending and self._in_flight < self.max_requests:
            self._sender_pending = True
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._send())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[_Waiting]:
        batch, size = [], 0
        while self._waiting and (not batch or size + len(self._waiting[0].queries) <= self.max_queries):
            waiting = self._waiting.pop(0)
            batch.append(waiting)
            size += len(waiting.queries)
        return batch

    async def _send(self) -> None:
        try:
            batch = self._take_batch()
            self._sender_pending = False
            self._start_senders()  # what did not fit under max_queries goes in another request
            if batch:
                await self._retrieve(batch)
        finally:
            self._in_flight -= 1
            self._start_senders()

    async def _retrieve(self, batch: list[_Waiting]) -> None:
        queries = [q for waiting in batch for q in waiting.queries]
        self.stats.requests += 1
        self.stats.queries += len(queries)
        self.stats.calls += len(batch)
        try:
            hits = await self.client.retrieve(queries, topk=self.topk)
            if len(hits) != len(queries):
                raise ValueError(f"the server answered {len(hits)} result lists for {len(queries)} queries")
        except asyncio.CancelledError:
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the service becomes the calls' tool response
            problem = _short(exc)
            self.stats.failed_calls += len(batch)
            self.stats.errors.append(str(exc)[:500])
            log.warning(f"search failed for {len(batch)} tool calls ({len(queries)} queries): {exc}")
            for waiting in batch:
                _settle(waiting.future, SearchOutcome(error=problem))
            return
        start = 0
        for waiting in batch:
            end = start + len(waiting.queries)
            _settle(waiting.future, SearchOutcome(hits=hits[start:end]))
            start = end


def _settle(future: asyncio.Future, outcome: SearchOutcome) -> None:
    if not future.done():  # its trajectory may have been cancelled meanwhile
        future.set_result(outcome)


def _short(exc: BaseException) -> str:
    """The error in one line the model can read: no URLs, no tracebacks."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "gave up after" in text:
        return "the retrieval service did not answer"
    return text[:200]


# ------------------------------------------------------------------------------------------ the tool


class SearchTool:
    """verl's SearchTool over a SearchBatcher: one call searches its query_list."""

    def __init__(self, batcher: SearchBatcher, schema: dict, *, style: FormatName = "hermes") -> None:
        """style: the run's multi_turn.format, which decides how passages are written back."""
        self.batcher = batcher
        self.schema = schema
        self.name: str = schema["function"]["name"]
        self.style = style

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        queries, problem = query_list(arguments)
        if problem is not None:
            return ToolResult.invalid(response_text(self.style, problem))
        return search_result(self.style, await self.batcher.search(queries))

    async def wait_healthy(self, timeout_s: float) -> None:
        await self.batcher.client.wait_healthy(timeout_s)

    async def aclose(self) -> None:
        await self.batcher.aclose()


def search_result(style: FormatName, outcome: SearchOutcome) -> ToolResult:
    """What the model reads of one call's search: Search-R1's passages, or verl's SearchTool JSON."""
    if outcome.error is not None:
        if style == "search_r1":
            text = f"The search failed ({outcome.error}). Search again or give your answer."
        else:
            text = f"Search error: {outcome.error}"
        return ToolResult(response_text(style, text), "failed", outcome.error)
    hits = outcome.hits or []
    if style == "search_r1":
        return ToolResult(format_passages(hits[0]).strip() if hits and hits[0] else "")
    if not any(hits):
        return ToolResult(response_text(style, "No search results found."))
    return ToolResult(response_text(style, "\n---\n".join(verl_passages(query_hits) for query_hits in hits)))


def response_text(style: FormatName, result: str) -> str:
    """hermes: verl's SearchTool answers `{"result": ...}`; Search-R1 reads the bare text."""
    return result if style == "search_r1" else json.dumps({"result": result}, ensure_ascii=False)


def query_list(arguments: Mapping[str, Any]) -> tuple[tuple[str, ...], str | None]:
    """verl's SearchTool argument: a non-empty list of non-empty strings; -> (queries, problem)."""
    queries = arguments.get("query_list")
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) for q in queries):
        return (), "Error: 'query_list' is missing, empty, or not a list of strings."
    queries = [q.strip() for q in queries]
    if not all(queries):
        return (), "Error: 'query_list' holds an empty query."
    return tuple(queries), None


def verl_passages(hits: list[Hit]) -> str:
    """One query's passages as verl's SearchTool writes them: `Doc i (Title: t)\\ntext`, blank-line apart."""
    blocks = []
    for i, hit in enumerate(hits, start=1):
        title, _, text = hit.document.contents.partition("\n")
        blocks.append(f"Doc {i} (Title: {title})\n{text}")
    return "\n\n".join(blocks)
