"""AgentLoop: multi-turn rollouts that search while they generate, one coroutine per trajectory.

    trajectory: generate until a closed tool call, an answer, the end of the turn or the budget
                -> parse the turn -> search (in one /retrieve with every other waiting trajectory)
                -> append the tool response's tokens (loss mask 0) -> generate again ...

Every model turn is its own request through the rollout manager's async path (`generate_async`: the
replica pool's routing, continuous batching in the engine), so a trajectory waiting for its search
holds back nobody's generation, and nothing waits for a whole batch between turns. A trajectory's turns
all go to the replica of its first turn (a routing key), where its prefix was computed; a prompt's
group is handed on (`on_group`, the fit loop's scoring) as soon as its n trajectories end.

Token in, token out: a turn's prompt is the trajectory's prompt ids plus every id appended so far,
exactly as sampled or encoded; text is decoded only to find the tool calls, never re-encoded. The
Rollout's loss_mask is 1 on the model's tokens and 0 on the tool responses' (and the template text
around them), and its logprobs are 0 there; the policy loss, KL, entropy and response-length metrics
count the loss mask only.

Limits, as verl's ToolAgentLoop: a trajectory ends after multi_turn.max_assistant_turns model turns
(or max_user_turns tool turns), when its tokens reach data.max_response_length (each turn may only
use what is left), or when a tool response would not fit (the last turn is then the model's, so the
final reward lands on a model token). Tool calls beyond max_parallel_calls in one turn are ignored.

Metrics (verl's names): num_turns/{mean,max,min} counts the prompt, the model turns and the tool
turns of a trajectory (a plain single-turn answer is 2); tool_calls/{mean,max} per trajectory;
tool/errors: calls whose search failed after its retries; timing_s/tool_calls: wall time during
which at least one search was in flight (so tool time / step time is the share of the step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from trainer.agent.formats import ToolCall, ToolFormat, Truncation, TruncateSide, encode_literal
from trainer.agent.search import SearchBatcher, SearchOutcome, SearchStats
from trainer.rollout.base import FinishReason, Rollout, SamplingParams


class TurnEngine(Protocol):
    """What the loop needs of the rollout: RolloutManager.generate_async and forget."""

    async def generate_async(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        first_index: int = 0,
        key: str | None = None,
    ) -> list[Rollout]: ...

    def forget(self, keys: Sequence[str]) -> None: ...


OnGroup = Callable[[int, list[Rollout]], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """actor_rollout_ref.rollout.multi_turn.* and the response budget, resolved once."""

    max_response_length: int  # model + tool tokens of one trajectory (data.max_response_length)
    max_assistant_turns: int | None = None  # model turns per trajectory; None: only the length limits
    max_user_turns: int | None = None  # tool turns per trajectory; None: only the length limits
    max_parallel_calls: int = 1  # tool calls run per model turn
    max_tool_response_length: int = 256  # tokens of one tool response before truncation
    tool_response_truncate_side: TruncateSide = "middle"

    def __post_init__(self) -> None:
        if self.max_response_length < 1 or self.max_parallel_calls < 1:
            raise ValueError("max_response_length and max_parallel_calls must be >= 1")
        for name in ("max_assistant_turns", "max_user_turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(self, name)}")


@dataclass
class Trajectory:
    """One sample's growing response: ids, logprobs and loss mask stay aligned token for token."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    tool_turns: int = 0
    tool_calls: int = 0  # calls run (searches, and calls refused with a problem)
    tool_errors: int = 0  # calls whose search failed after its retries
    invalid_calls: int = 0  # calls that could not run (empty query, bad JSON, unknown tool)
    finish_reason: FinishReason = "stop"

    def add_model_turn(self, turn: Rollout) -> None:
        self.response_ids += turn.response_ids
        self.logprobs += turn.logprobs
        self.loss_mask += [1] * len(turn.response_ids)
        self.assistant_turns += 1
        self.finish_reason = turn.finish_reason

    def add_tool_turn(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.tool_turns += 1

    @property
    def num_turns(self) -> int:
        return 1 + self.assistant_turns + self.tool_turns

    def rollout(self) -> Rollout:
        return Rollout(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            finish_reason=self.finish_reason,
            prompt_index=self.prompt_index,
        )


class ToolClock:
    """Wall time during which at least one tool call is in flight (overlapping calls count once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> ToolClock:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1
        return self

    def __exit__(self, *exc) -> None:
        self._active -= 1
        if self._active == 0:
            self.seconds += time.perf_counter() - self._since


@dataclass
class AgentBatch:
    """One generate() call: rollouts in prompt order (n per prompt) and what the tools did."""

    rollouts: list[Rollout]
    trajectories: list[Trajectory]
    tool_seconds: float
    search: SearchStats

    @classmethod
    def merged(cls, batches: Sequence[AgentBatch]) -> AgentBatch:
        """Several generate() calls of one step (DAPO refills) as one."""
        search = SearchStats(
            requests=sum(b.search.requests for b in batches),
            queries=sum(b.search.queries for b in batches),
            calls=sum(b.search.calls for b in batches),
            failed_calls=sum(b.search.failed_calls for b in batches),
            errors=[e for b in batches for e in b.search.errors],
        )
        return cls(
            [r for b in batches for r in b.rollouts],
            [t for b in batches for t in b.trajectories],
            sum(b.tool_seconds for b in batches),
            search,
        )

    def metrics(self) -> dict[str, float]:
        turns = np.array([t.num_turns for t in self.trajectories], dtype=np.float64)
        calls = np.array([t.tool_calls for t in self.trajectories], dtype=np.float64)
        metrics = {
            "num_turns/mean": float(turns.mean()),
            "num_turns/max": float(turns.max()),
            "num_turns/min": float(turns.min()),
            "tool_calls/mean": float(calls.mean()),
            "tool_calls/max": float(calls.max()),
            "tool/errors": float(sum(t.tool_errors for t in self.trajectories)),
            "tool/invalid_calls": float(sum(t.invalid_calls for t in self.trajectories)),
            "tool/retrieve_requests": float(self.search.requests),
        }
        if self.search.requests:
            metrics["tool/queries_per_request"] = self.search.queries / self.search.requests
        return metrics


def turn_seed(seed: int, trajectory: int, turn: int) -> int:
    """A distinct, reproducible seed for every turn of every trajectory of a seeded batch."""
    mixed = np.random.SeedSequence([seed & (2**63 - 1), trajectory, turn]).generate_state(1, np.uint64)[0]
    return int(mixed >> np.uint64(1))


class AgentLoop:
    def __init__(
        self,
        engine: TurnEngine,
        tokenizer,
        tool_format: ToolFormat,
        searcher: SearchBatcher,
        settings: AgentSettings,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.format = tool_format
        self.searcher = searcher
        self.settings = settings
        self.truncation = Truncation.build(
            tokenizer, settings.max_tool_response_length, settings.tool_response_truncate_side
        )

    async def generate(
        self, prompt_ids: Sequence[list[int]], sampling: SamplingParams, on_group: OnGroup | None = None
    ) -> AgentBatch:
        """sampling.n trajectories per prompt, all at once; rollouts grouped by prompt, as engines do.
        on_group(index, rollouts) gets each prompt's n rollouts as soon as they all end."""
        n, batch_key = sampling.n, uuid.uuid4().hex
        trajectories = [
            Trajectory(index, list(prompt)) for index, prompt in enumerate(prompt_ids) for _ in range(n)
        ]
        clock = ToolClock()
        self.searcher.take_stats()

        async def group(index: int) -> None:
            numbers = range(index * n, (index + 1) * n)
            keys = [f"{batch_key}-{number}" for number in numbers]
            try:
                await asyncio.gather(
                    *(self.run(trajectories[i], i, sampling, clock, key) for i, key in zip(numbers, keys))
                )
            finally:
                self.engine.forget(keys)
            if on_group is not None:
                await on_group(index, [trajectories[i].rollout() for i in numbers])

        await asyncio.gather(*(group(index) for index in range(len(prompt_ids))))
        return AgentBatch(
            [t.rollout() for t in trajectories], trajectories, clock.seconds, self.searcher.take_stats()
        )

    async def run(
        self,
        trajectory: Trajectory,
        number: int,
        sampling: SamplingParams,
        clock: ToolClock,
        key: str | None = None,
    ) -> None:
        """Turns until an end condition; the trajectory fills in place. key: the routing key of its turns."""
        settings = self.settings
        stop = tuple(dict.fromkeys((*sampling.stop, *self.format.stop)))
        while True:
            budget = settings.max_response_length - len(trajectory.response_ids)
            turn_sampling = dataclasses.replace(
                sampling,
                n=1,
                max_new_tokens=budget,
                stop=stop,
                seed=None
                if sampling.seed is None
                else turn_seed(sampling.seed, number, trajectory.assistant_turns),
            )
            context = trajectory.prompt_ids + trajectory.response_ids
            (turn,) = await self.engine.generate_async([context], turn_sampling, key=key)
            trajectory.add_model_turn(turn)
            if turn.finish_reason != "stop" or len(trajectory.response_ids) >= settings.max_response_length:
                return
            if settings.max_assistant_turns and trajectory.assistant_turns >= settings.max_assistant_turns:
                return
            if settings.max_user_turns and trajectory.tool_turns >= settings.max_user_turns:
                return
            text = self.tokenizer.decode(turn.response_ids, skip_special_tokens=False)
            calls = self.format.parse(text)[: settings.max_parallel_calls]
            if not calls:
                return
            with clock:
                contents = await self.call_tools(trajectory, calls)
            tail = self.tokenizer.decode(turn.response_ids[-1:], skip_special_tokens=False)
            observation = self.format.observation(contents, tail)
            if len(trajectory.response_ids) + len(observation) >= settings.max_response_length:
                return  # no room for another model turn after it: end on the model's turn
            trajectory.add_tool_turn(observation)

    async def call_tools(self, trajectory: Trajectory, calls: list[ToolCall]) -> list[list[int]]:
        """Run a turn's calls together; -> each tool response's (truncated) token ids."""

        async def one(call: ToolCall) -> SearchOutcome | None:
            return None if call.problem is not None else await self.searcher.search(call.queries)

        outcomes = await asyncio.gather(*(one(call) for call in calls))
        trajectory.tool_calls += len(calls)
        trajectory.invalid_calls += sum(call.problem is not None for call in calls)
        trajectory.tool_errors += sum(o is not None and o.error is not None for o in outcomes)
        return [
            self.truncation.apply(encode_literal(self.tokenizer, self.format.result_text(call, outcome)))
            for call, outcome in zip(calls, outcomes)
        ]

    async def aclose(self) -> None:
        await self.searcher.aclose()
