"""Wire contract of the retrieval-server (pydantic, torch-free): Search-R1's `/retrieve`, exactly.

Request  `{"queries": [...], "topk": 3, "return_scores": true}`
Response `{"result": [[{"document": {"id": ..., "contents": ...}, "score": s}, ...] per query]}`
         or, with `return_scores` false, `{"result": [[{"id": ..., "contents": ...}, ...] per query]}`.

The defaults are Search-R1's: `topk` omitted or null means the server's default (3), and
`return_scores` is false unless asked for. `contents` is `"Title"\\ntext`, the corpus format that
verl's SearchTool splits into a title line and a body.
"""

from __future__ import annotations

import re
from typing import Annotated

from services.common.wire import JsonInt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, WithJsonSchema


# A query needs one character that is not ASCII white space. Spelled out, not `\S`: Python's and the
# JSON Schema (ECMA) regex engines disagree on which other characters are white space.
NOT_BLANK = r"[^ \t\n\r\f\v]"
_NOT_BLANK = re.compile(NOT_BLANK)


def _not_blank(query: str) -> str:
    if _NOT_BLANK.search(query) is None:
        raise ValueError("query is an empty string")
    return query


Query = Annotated[
    StrictStr, AfterValidator(_not_blank), WithJsonSchema({"type": "string", "pattern": NOT_BLANK})
]


class RetrieveRequest(BaseModel):
    """Strict types: `topk: "3"` or `return_scores: "yes"` is a 422, not a silent coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)

    queries: list[Query] = Field(..., min_length=1, description="Search queries; one result list per query.")
    topk: JsonInt | None = Field(
        None, description="Passages per query, 1..max_topk; omitted or null: the server's default_topk."
    )
    return_scores: bool = Field(
        False, description="true: each hit is {document, score}; false: the document alone."
    )


class Document(BaseModel):
    """One corpus passage as the store holds it."""

    model_config = ConfigDict(extra="allow")

    id: str
    contents: str = Field(description='"Title"\\ntext, as in Search-R1\'s wiki-18 corpus.')

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip('"')

    @property
    def text(self) -> str:
        return self.contents.split("\n", 1)[1] if "\n" in self.contents else ""


class Hit(BaseModel):
    document: Document
    score: float | None = Field(None, description="Inner product of normalised embeddings (BM25: its score).")


class RetrieveResponse(BaseModel):
    result: list[list[Hit]] | list[list[Document]] = Field(
        description="Per query, the topk best passages, best first ({document, score} when return_scores)."
    )
