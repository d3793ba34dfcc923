"""Async client of the retrieval-server, for the trainer's agent loop (retries: services.common.client)."""

from __future__ import annotations

from services.common.client import ServiceClient
from services.retrieval_server.schemas import Document, Hit


class RetrievalClient(ServiceClient):
    async def retrieve(
        self, queries: list[str], topk: int | None = None, return_scores: bool = True
    ) -> list[list[Hit]]:
        """Per query, the topk passages, best first (score None when return_scores is false); topk None:
        the server's --default-topk."""
        payload = {"queries": list(queries), "topk": topk, "return_scores": return_scores}
        result = (await self.http.post("/retrieve", payload))["result"]
        if return_scores:
            return [[Hit.model_validate(hit) for hit in hits] for hits in result]
        return [[Hit(document=Document.model_validate(doc)) for doc in docs] for docs in result]


def format_passages(hits: list[Hit]) -> str:
    """One query's hits as the text Search-R1's policy was trained to read (inside <information>).

    Search-R1 writes `Doc i(Title: <first line of contents, quotes kept>) <rest>` one per line.
    """
    lines = []
    for i, hit in enumerate(hits, start=1):
        title, _, text = hit.document.contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)
