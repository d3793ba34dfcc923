"""AgentLoop: multi-turn rollouts that call tools while they generate, one coroutine per trajectory.

    trajectory: generate until a closed tool call, an answer, the end of the turn or the budget
                -> parse the turn -> run its calls (searches go in one /retrieve with every other
                waiting trajectory's; code runs go to the code-executor) -> append the tool responses'
                tokens (loss mask 0) -> generate again ...

Every model turn is its own request through the rollout manager's async path (`generate_async`: the
replica pool's routing, continuous batching in the engine), so a trajectory waiting for its tools
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

A tool that fails (its service down after the client's retries, a sandbox error; not a program that
raised, nor a call with bad arguments) is handled by multi_turn.tool_failure:
    text        the failure text is the tool response and the trajectory goes on (verl's behaviour)
    retry       the call runs again, up to tool_failure_retries more times, then as text
    drop_group  the trajectory ends at once, the other trajectories of its prompt end at their next
                tool turn, and the batch names the prompt (AgentBatch.failed_prompts) so the trainer
                drops the whole group from the step: no gradient from "search failed" text
Trajectory.failed_tool marks every trajectory whose last try of a call failed, under any policy.

Metrics (verl's names where verl has them): num_turns/{mean,max,min} counts the prompt, the model
turns and the tool turns of a trajectory (a plain single-turn answer is 2); tool_calls/{mean,max} per
trajectory; tool/errors: calls that failed after their retries; tool/invalid_calls; per tool
tool/{name}/{calls,errors,invalid_calls,retries} and timing_s/tool_calls/{name}; tool/dropped_groups
under drop_group; timing_s/tool_calls: wall time during which at least one call was in flight (so
tool time / step time is the share of the step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from services.common.client import backoff_delay
from trainer.agent.formats import (
    HermesFormat,
    ToolCall,
    ToolFormat,
    ToolResult,
    Truncation,
    TruncateSide,
    encode_literal,
)
from trainer.agent.search import SearchStats, SearchTool
from trainer.rollout.base import FinishReason, Rollout, SamplingParams, derived_seed

log = logging.getLogger("trainer")

FailurePolicy = Literal["text", "drop_group", "retry"]


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


class Tool(Protocol):
    """What the loop needs of a tool (search.SearchTool, code.CodeTool)."""

    name: str
    schema: dict

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run one call; never raises for the service's failures (a failed result instead)."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """actor_rollout_ref.rollout.multi_turn.* and the response budget, resolved once."""

    max_response_length: int  # model + tool tokens of one trajectory (data.max_response_length)
    max_assistant_turns: int | None = None  # model turns per trajectory; None: only the length limits
    max_user_turns: int | None = None  # tool turns per trajectory; None: only the length limits
    max_parallel_calls: int = 1  # tool calls run per model turn
    max_tool_response_length: int = 256  # tokens of one tool response before truncation
    tool_response_truncate_side: TruncateSide = "middle"
    tool_failure: FailurePolicy = "text"  # what a failed tool call does (module docstring)
    tool_failure_retries: int = 2  # tool_failure=retry: more tries of a failed call
    retry_backoff_s: float = 0.5  # tool_failure=retry: first backoff (full jitter, doubling, <= 8 s)

    def __post_init__(self) -> None:
        if self.max_response_length < 1 or self.max_parallel_calls < 1:
            raise ValueError("max_response_length and max_parallel_calls must be >= 1")
        for name in ("max_assistant_turns", "max_user_turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.tool_failure not in ("text", "drop_group", "retry"):
            raise ValueError(f"tool_failure must be text, drop_group or retry, not {self.tool_failure!r}")
        if self.tool_failure_retries < 1 or self.retry_backoff_s < 0:
            raise ValueError("tool_failure_retries must be >= 1 and retry_backoff_s >= 0")

    @property
    def tries(self) -> int:
        """Tries of one call: 1, or 1 + the retries under tool_failure=retry."""
        return 1 + self.tool_failure_retries if self.tool_failure == "retry" else 1


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
    tool_calls: int = 0  # calls made (run, or refused with a problem)
    tool_errors: int = 0  # calls whose tool failed on its last try
    invalid_calls: int = 0  # calls that could not run (bad JSON, unknown tool, bad arguments)
    finish_reason: FinishReason = "stop"

    @property
    def failed_tool(self) -> bool:
        """A call of this trajectory failed on its last try (what tool_failure=drop_group drops)."""
        return self.tool_errors > 0

    def add_model_turn(self, turn: Rollout) -> None:
        self.response_ids += turn.response_ids.tolist()
        self.logprobs += turn.logprobs.tolist()
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
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            loss_mask=self.loss_mask,
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
class ToolStats:
    """One tool's calls in one generate(): the per-tool metrics."""

    calls: int = 0  # calls that reached the tool (the model named it)
    invalid_calls: int = 0  # its arguments were unusable
    errors: int = 0  # failed on the last try
    retries: int = 0  # tries after a failure (tool_failure=retry)
    seconds: float = 0.0  # wall time with a call of this tool in flight

    def add(self, other: ToolStats) -> ToolStats:
        return ToolStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass
class AgentBatch:
    """One generate() call: rollouts in prompt order (n per prompt) and what the tools did."""

    rollouts: list[Rollout]
    trajectories: list[Trajectory]
    tool_seconds: float
    search: SearchStats
    tools: dict[str, ToolStats] = field(default_factory=dict)
    dropped_groups: int = 0  # tool_failure=drop_group: prompts named in failed_prompts

    @property
    def failed_prompts(self) -> list[int]:
        """Prompt indices (of this generate() call) with a trajectory whose tool failed: under
        tool_failure=drop_group the trainer drops these prompt groups from the step."""
        return sorted({t.prompt_index for t in self.trajectories if t.failed_tool})

    @classmethod
    def merged(cls, batches: Sequence[AgentBatch]) -> AgentBatch:
        """Several generate() calls of one step (DAPO refills) as one, for the metrics (prompt indices
        repeat across calls: take failed_prompts of each call before merging)."""
        search = SearchStats(
            requests=sum(b.search.requests for b in batches),
            queries=sum(b.search.queries for b in batches),
            calls=sum(b.search.calls for b in batches),
            failed_calls=sum(b.search.failed_calls for b in batches),
            errors=[e for b in batches for e in b.search.errors],
        )
        tools: dict[str, ToolStats] = {}
        for batch in batches:
            for name, stats in batch.tools.items():
                tools[name] = tools.get(name, ToolStats()).add(stats)
        return cls(
            [r for b in batches for r in b.rollouts],
            [t for b in batches for t in b.trajectories],
            sum(b.tool_seconds for b in batches),
            search,
            tools,
            sum(b.dropped_groups for b in batches),
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
            "tool/failed_trajectories": float(sum(t.failed_tool for t in self.trajectories)),
            "tool/dropped_groups": float(self.dropped_groups),
            "tool/retrieve_requests": float(self.search.requests),
        }
        if self.search.requests:
            metrics["tool/queries_per_request"] = self.search.queries / self.search.requests
        for name, stats in self.tools.items():
            metrics[f"tool/{name}/calls"] = float(stats.calls)
            metrics[f"tool/{name}/errors"] = float(stats.errors)
            metrics[f"tool/{name}/invalid_calls"] = float(stats.invalid_calls)
            metrics[f"tool/{name}/retries"] = float(stats.retries)
            metrics[f"timing_s/tool_calls/{name}"] = stats.seconds
        return metrics


@dataclass
class _Step:
    """What the trajectories of one generate() share: the clocks, the per-tool counts, and the prompts
    whose group a failed tool call condemned (tool_failure=drop_group)."""

    clock: ToolClock
    clocks: dict[str, ToolClock]
    stats: dict[str, ToolStats]
    failed_prompts: set[int] = field(default_factory=set)

    @classmethod
    def start(cls, names: Sequence[str]) -> _Step:
        return cls(ToolClock(), {n: ToolClock() for n in names}, {n: ToolStats() for n in names})

    def tool_stats(self) -> dict[str, ToolStats]:
        return {
            name: dataclasses.replace(stats, seconds=self.clocks[name].seconds)
            for name, stats in self.stats.items()
        }


class AgentLoop:
    def __init__(
        self,
        engine: TurnEngine,
        tokenizer,
        tool_format: ToolFormat,
        tools: Sequence[Tool],
        settings: AgentSettings,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.format = tool_format
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools) or not tools:
            raise ValueError(f"the agent needs tools with distinct names, got {[t.name for t in tools]}")
        self.search = next((tool for tool in tools if isinstance(tool, SearchTool)), None)
        self.settings = settings
        self.truncation = Truncation.build(
            tokenizer, settings.max_tool_response_length, settings.tool_response_truncate_side
        )
        self._rng = random.Random()
        self._prompts_checked = False

    def check_prompt(self, prompt: Sequence[int]) -> str | None:
        """A warning when the prompts teach tool calls this format does not parse (checked once a run):
        hermes reads <tool_call> JSON only, so prompts teaching Search-R1's <search> tags (a QA set
        served with its default instruction) train without a single search."""
        if not isinstance(self.format, HermesFormat):
            return None
        if "<search>" not in self.tokenizer.decode(list(prompt), skip_special_tokens=False):
            return None
        return (
            "multi_turn.format=hermes, but the prompts teach Search-R1's <search> tags, which hermes does "
            "not parse: no search will be called. Serve QA prompts with the data-server's "
            "--qa-instruction tools, or train with multi_turn.format=search_r1"
        )

    async def generate(
        self, prompt_ids: Sequence[list[int]], sampling: SamplingParams, on_group: OnGroup | None = None
    ) -> AgentBatch:
        """sampling.n trajectories per prompt, all at once; rollouts grouped by prompt, as engines do.
        on_group(index, rollouts) gets each prompt's n rollouts as soon as they all end, except under
        tool_failure=drop_group the groups in the batch's failed_prompts, which are not to be trained on."""
        if not self._prompts_checked and prompt_ids:
            self._prompts_checked = True
            if (warning := self.check_prompt(prompt_ids[0])) is not None:
                log.warning(warning)
        n, batch_key = sampling.n, uuid.uuid4().hex
        trajectories = [
            Trajectory(index, list(prompt)) for index, prompt in enumerate(prompt_ids) for _ in range(n)
        ]
        step = _Step.start(list(self.tools))
        if self.search is not None:
            self.search.batcher.take_stats()

        async def group(index: int) -> None:
            numbers = range(index * n, (index + 1) * n)
            keys = [f"{batch_key}-{number}" for number in numbers]
            try:
                await asyncio.gather(
                    *(self.run(trajectories[i], i, sampling, step, key) for i, key in zip(numbers, keys))
                )
            finally:
                self.engine.forget(keys)
            # All n trajectories have ended, so a drop_group verdict on this prompt is final: a group the
            # trainer will drop is not handed on, and nothing scores it.
            if on_group is not None and index not in step.failed_prompts:
                await on_group(index, [trajectories[i].rollout() for i in numbers])

        await asyncio.gather(*(group(index) for index in range(len(prompt_ids))))
        search = self.search.batcher.take_stats() if self.search is not None else SearchStats()
        batch = AgentBatch([t.rollout() for t in trajectories], trajectories, step.clock.seconds, search)
        batch.tools = step.tool_stats()
        if self.settings.tool_failure == "drop_group":
            batch.dropped_groups = len(batch.failed_prompts)
        return batch

    async def run(
        self,
        trajectory: Trajectory,
        number: int,
        sampling: SamplingParams,
        step: _Step,
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
                else derived_seed(sampling.seed, number, trajectory.assistant_turns),
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
            text = self.tokenizer.decode(turn.response_ids.tolist(), skip_special_tokens=False)
            calls = self.format.parse(text)[: settings.max_parallel_calls]
            if not calls:
                return
            contents = await self.call_tools(trajectory, calls, step)
            if settings.tool_failure == "drop_group":
                if trajectory.failed_tool:
                    step.failed_prompts.add(trajectory.prompt_index)
                if trajectory.prompt_index in step.failed_prompts:
                    return  # its group is dropped: end on the model's turn, spend nothing more on it
            tail = self.tokenizer.decode(turn.response_ids[-1:].tolist(), skip_special_tokens=False)
            observation = self.format.observation(contents, tail)
            if len(trajectory.response_ids) + len(observation) >= settings.max_response_length:
                return  # no room for another model turn after it: end on the model's turn
            trajectory.add_tool_turn(observation)

    async def call_tools(self, trajectory: Trajectory, calls: list[ToolCall], step: _Step) -> list[list[int]]:
        """Run a turn's calls together; -> each tool response's (truncated) token ids."""
        results = await asyncio.gather(*(self.call_tool(call, step) for call in calls))
        trajectory.tool_calls += len(calls)
        trajectory.invalid_calls += sum(r.status == "invalid" for r in results)
        trajectory.tool_errors += sum(r.status == "failed" for r in results)
        return [self.truncation.apply(encode_literal(self.tokenizer, r.text)) for r in results]

    async def call_tool(self, call: ToolCall, step: _Step) -> ToolResult:
        """One call, tried again on failure under tool_failure=retry (with backoff)."""
        if call.problem is not None or call.name not in self.tools:
            if call.name in step.stats:
                step.stats[call.name].calls += 1
                step.stats[call.name].invalid_calls += 1
            return ToolResult.invalid(call.problem or f"Error: unknown tool {call.name!r}.")
        tool, stats = self.tools[call.name], step.stats[call.name]
        stats.calls += 1
        with step.clock, step.clocks[call.name]:
            for attempt in range(self.settings.tries):
                if attempt:
                    stats.retries += 1
                    delay = backoff_delay(attempt - 1, self.settings.retry_backoff_s, 8.0, self._rng)
                    await asyncio.sleep(delay)
                result = await tool.call(call.arguments)
                if result.status != "failed":
                    break
        stats.invalid_calls += result.status == "invalid"
        stats.errors += result.status == "failed"
        return result

    async def aclose(self) -> None:
        await asyncio.gather(*(tool.aclose() for tool in self.tools.values()))
