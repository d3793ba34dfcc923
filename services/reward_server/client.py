"""Async client of the reward-server, for the trainer. Retries and replicas: services.common.client.

`RewardClient.score(items, options)` has the same signature and result as `LocalScorer.score`, so
the trainer can hold either. A long list is split into requests that respect the server's limits
(items per request, body bytes; read once from GET /v1/scorers) and sent a few at a time, spread
over the replicas.

Retries cannot pile work up on a server: the default timeout (300 s) is above the server's request
deadline (120 s), so the server answers first (late items carry a deadline error); and a request the
client does give up on closes its connection, which makes the server drop that request's work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import orjson

from services.common.client import ServiceClient
from services.reward_server.schemas import (
    RewardItem,
    RewardOptions,
    RewardResult,
    ScorersResponse,
)

FALLBACK_MAX_ITEMS = 1024
BODY_OVERHEAD_BYTES = 4096  # the envelope and options around the items


def _plain(value):
    """orjson's fallback for what verl rows hold: numpy arrays and scalars (ground truths from parquet)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot send {type(value).__name__} to the reward-server")


def encode_item(item: RewardItem | dict) -> bytes:
    fields = item if isinstance(item, dict) else vars(item)
    return orjson.dumps(fields, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY)


def request_body(encoded_items: Sequence[bytes], options: RewardOptions | None) -> bytes:
    envelope = b'{"items":[' + b",".join(encoded_items) + b"]"
    if options is not None:
        envelope += b',"options":' + options.model_dump_json().encode()
    return envelope + b"}"


def chunk_items(encoded_items: Sequence[bytes], max_items: int, max_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges holding at most `max_items` items and about `max_bytes` bytes of them."""
    start, size = 0, 0
    for index, encoded in enumerate(encoded_items):
        if index > start and (index - start >= max_items or size + len(encoded) + 1 > max_bytes):
            yield start, index
            start, size = index, 0
        size += len(encoded) + 1
    if start < len(encoded_items):
        yield start, len(encoded_items)


def limits_of(scorers: dict) -> tuple[int, int]:
    """(items, bytes) one request may carry, from a GET /v1/scorers answer."""
    limits = scorers.get("limits", {})
    max_items = int(limits.get("max_items", FALLBACK_MAX_ITEMS))
    max_bytes = int(limits.get("max_request_bytes", 16 * 1024 * 1024)) - BODY_OVERHEAD_BYTES
    return max_items, max_bytes


class RewardClient(ServiceClient):
    """Scores through one or more reward-server replicas.

    `score` splits a list into requests within the server's limits (and `max_items_per_request`),
    `max_in_flight` at a time; `policy` is AsyncServiceClient's (retries, backoff_s, token, ...).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_items_per_request: int | None = None,
        max_in_flight: int = 4,
        timeout_s: float = 300.0,
        **policy,
    ) -> None:
        super().__init__(urls, timeout_s=timeout_s, **policy)
        self.max_items_per_request = max_items_per_request
        self.max_in_flight = max_in_flight
        self._limits: tuple[int, int] | None = None

    async def scorers(self) -> ScorersResponse:
        return ScorersResponse.model_validate(await self.http.get("/v1/scorers"))

    async def limits(self) -> tuple[int, int]:
        if self._limits is None:
            max_items, max_bytes = limits_of(await self.http.get("/v1/scorers"))
            if self.max_items_per_request is not None:
                max_items = min(max_items, self.max_items_per_request)
            self._limits = (max_items, max_bytes)
        return self._limits

    async def score(
        self, items: Sequence[RewardItem | dict], options: RewardOptions | None = None
    ) -> list[RewardResult]:
        """One result per item, in order. Raises ServiceError if the server stays unreachable or refuses."""
        if not items:
            return []
        max_items, max_bytes = await self.limits()
        encoded = [encode_item(item) for item in items]
        gate = asyncio.Semaphore(self.max_in_flight)

        async def send(start: int, stop: int) -> list[dict]:
            async with gate:
                answer = await self.http.request(
                    "POST",
                    "/v1/rewards",
                    content=request_body(encoded[start:stop], options),
                    headers={"content-type": "application/json"},
                )
            return answer["results"]

        chunks = await asyncio.gather(*(send(a, b) for a, b in chunk_items(encoded, max_items, max_bytes)))
        return [RewardResult(**result) for chunk in chunks for result in chunk]
