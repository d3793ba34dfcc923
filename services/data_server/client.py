"""Async client of the data-server, for the trainer. Retries and replicas: services.common.client."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.client import AsyncServiceClient
from services.data_server.schemas import BatchResponse, DatasetsResponse


class DataClient:
    def __init__(self, urls: str | Sequence[str], **policy) -> None:
        self.http = AsyncServiceClient(urls, **policy)

    async def __aenter__(self) -> DataClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        await self.http.wait_healthy(timeout_s)

    async def batch(self, dataset: str, split: str, batch_size: int, cursor: str | None = None) -> BatchResponse:
        """The batch at `cursor` (None: the very first); pass `next_cursor` back for the next one."""
        payload = {"dataset": dataset, "split": split, "batch_size": batch_size, "cursor": cursor}
        return BatchResponse.model_validate(await self.http.post("/v1/batches", payload))

    async def datasets(self) -> DatasetsResponse:
        return DatasetsResponse.model_validate(await self.http.get("/v1/datasets"))
