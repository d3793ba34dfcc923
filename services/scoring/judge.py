"""An LLM judge: scores responses by asking any OpenAI-compatible chat endpoint (vLLM, SGLang, our rollout
server's /v1/chat/completions, a hosted API) to grade them, as TRL users wire judge rewards.

    async with LLMJudge(JudgeSettings(url="http://127.0.0.1:30000/v1", model="default")) as judge:
        results = await judge.score([JudgeItem(prompt="2+3?", response="5", reference="5")])

Batched and bounded: every item of a batch is one chat request, at most `concurrency` in flight (over
every batch that one judge scores at once: the reward-server's `judge` scorer shares one), each
within `timeout_s`, retried `retries` times on a transport error or a 429/5xx. The judge's reply must hold
a number (the last one in "score: 7" style text counts), divided by `scale` into [0, 1]. An item the judge
could not score gets `error` (HTTP status, timeout, or the unparseable reply) and no score: callers count
them rather than train on a silent 0.

A judge holds no connection between batches: each `score` call opens its own HTTP client, so one judge
serves any event loop (the reward-server's, or each `asyncio.run` of the trainer's in-process scoring).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, Field

DEFAULT_TEMPLATE = (
    "Grade the response to the question on a scale of 0 to {scale}.\n"
    "Question: {prompt}\nReference answer: {reference}\nResponse: {response}\n"
    "Answer with the grade only, as 'Score: N'."
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RETRYABLE = frozenset({429, 500, 502, 503, 504})


class JudgeSettings(BaseModel):
    """Where the judge is and how hard it may be pushed."""

    url: str = Field(..., description="The endpoint's base URL, ending in /v1 (…/chat/completions is added).")
    model: str = Field("default", description="The `model` field sent with each request.")
    api_key: str | None = Field(None, description="Bearer token, when the endpoint wants one.")
    template: str = Field(
        DEFAULT_TEMPLATE,
        description="The user message; {prompt}, {response}, {reference}, {scale} are filled.",
    )
    scale: float = Field(10.0, gt=0, description="The grade that means 1.0.")
    max_tokens: int = Field(16, ge=1, description="Longest reply the judge may write.")
    temperature: float = Field(0.0, ge=0, description="0: greedy, the same grade for the same input.")
    concurrency: int = Field(8, ge=1, description="Most requests in flight at once.")
    timeout_s: float = Field(60.0, gt=0, description="Bound on one request, connection included.")
    retries: int = Field(2, ge=0, description="Extra tries after a transport error, a 429 or a 5xx.")


@dataclass(frozen=True)
class JudgeItem:
    prompt: str
    response: str
    reference: str = ""


@dataclass(frozen=True)
class JudgeResult:
    score: float | None  # in [0, 1] when the judge answered with a grade
    reply: str | None  # what the judge wrote
    error: str | None = None


def parse_grade(reply: str, scale: float) -> float | None:
    """The last number in the reply over scale, clipped to [0, 1]; None when there is no number."""
    numbers = NUMBER.findall(reply or "")
    if not numbers:
        return None
    return min(max(float(numbers[-1]) / scale, 0.0), 1.0)


class LLMJudge:
    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        self._headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._endpoint = settings.url.rstrip("/") + "/chat/completions"
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def __aenter__(self) -> LLMJudge:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Nothing to release (each batch closes its own client); kept for `async with`."""

    def _semaphore(self) -> asyncio.Semaphore:
        """The concurrency bound of the running event loop (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.settings.concurrency))
        return self._slots[1]

    async def score(self, items: Sequence[JudgeItem]) -> list[JudgeResult]:
        """One result per item, in order; never raises for one item's failure."""
        if not items:
            return []
        slots = self._semaphore()
        async with httpx.AsyncClient(timeout=self.settings.timeout_s, headers=self._headers) as http:
            return list(await asyncio.gather(*(self._one(http, slots, item) for item in items)))

    async def _one(self, http: httpx.AsyncClient, slots: asyncio.Semaphore, item: JudgeItem) -> JudgeResult:
        s = self.settings
        content = s.template.format(
            prompt=item.prompt, response=item.response, reference=item.reference, scale=s.scale
        )
        body = {
            "model": s.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
        }
        async with slots:
            reply, error = await self._ask(http, body)
        if error is not None:
            return JudgeResult(None, None, error)
        grade = parse_grade(reply, s.scale)
        if grade is None:
            return JudgeResult(None, reply, f"the judge's reply holds no grade: {reply[:200]!r}")
        return JudgeResult(grade, reply)

    async def _ask(self, http: httpx.AsyncClient, body: dict) -> tuple[str | None, str | None]:
        """(reply, None) or (None, why not) after the retries."""
        error = "not tried"
        for attempt in range(self.settings.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            try:
                response = await http.post(self._endpoint, json=body)
            except httpx.TimeoutException:
                error = f"{self._endpoint}: timed out after {self.settings.timeout_s:g}s"
                continue
            except httpx.TransportError as exc:
                error = f"{self._endpoint}: {type(exc).__name__}: {exc}"
                continue
            if response.status_code == 200:
                return _reply_text(response), None
            error = f"{self._endpoint}: HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code not in RETRYABLE:
                break
        return None, error


def _reply_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
