"""Async client of the code-executor, for the reward path and the agent loop's code tool (retries:
services.common.client). Runs that fail are answers, not errors: only the request failing raises."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.code_executor.schemas import (
    LanguagesResponse,
    RunBatchResponse,
    RunCodeRequest,
    RunCodeResponse,
)
from services.common.client import ServiceClient


class CodeExecutorClient(ServiceClient):
    async def run_code(self, request: RunCodeRequest) -> RunCodeResponse:
        """SandboxFusion's /run_code: one program."""
        return RunCodeResponse.model_validate(await self.http.post("/run_code", request.model_dump()))

    async def run_batch(
        self, requests: Sequence[RunCodeRequest], per_request: int = 512
    ) -> list[RunCodeResponse]:
        """Several programs at once (the server runs them in parallel); results in the order sent.
        A long list goes as several requests of `per_request` runs (the server's max_batch_runs
        is 1024 by default), sent together."""
        chunks = [requests[start : start + per_request] for start in range(0, len(requests), per_request)]
        answers = await asyncio.gather(*(self._batch(chunk) for chunk in chunks))
        return [response for answer in answers for response in answer]

    async def _batch(self, requests: Sequence[RunCodeRequest]) -> list[RunCodeResponse]:
        payload = {"runs": [request.model_dump() for request in requests]}
        return RunBatchResponse.model_validate(await self.http.post("/v1/runs", payload)).results

    async def languages(self) -> LanguagesResponse:
        return LanguagesResponse.model_validate(await self.http.get("/v1/languages"))
