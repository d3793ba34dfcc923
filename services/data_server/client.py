"""Async client of the data-server, for the trainer. Retries and replicas: services.common.client."""

from __future__ import annotations

from services.common.client import ServiceClient
from services.data_server.schemas import BatchResponse, DatasetsResponse


class DataClient(ServiceClient):
    async def batch(
        self, dataset: str, split: str, batch_size: int, cursor: str | None = None
    ) -> BatchResponse:
        """The batch at `cursor` (None: the very first); pass `next_cursor` back for the next one."""
        payload = {"dataset": dataset, "split": split, "batch_size": batch_size, "cursor": cursor}
        return BatchResponse.model_validate(await self.http.post("/v1/batches", payload))

    async def datasets(self) -> DatasetsResponse:
        return DatasetsResponse.model_validate(await self.http.get("/v1/datasets"))
