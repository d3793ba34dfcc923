"""A step's training data: prompts -> rollouts -> prompt groups scored as they finish -> the padded batch.

`collect_batch` runs one step's generation rounds inside the rollout phase (the colocated engines hold
their KV caches only then): each round asks the data source for prompts, hands them to the rollout
manager (or the agent loop, which calls tools between turns), and scores every prompt's group as soon
as its samples are back (GroupScoring), overlapped with the rest of the generation. DAPO's filter and
multi_turn.tool_failure=drop_group keep whole groups only (trainable_groups) and another round refills
what they dropped. The fit loop (trainer/loop.py) trains on what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.client import ServiceError
from trainer.agent.loop import AgentBatch, OnGroup
from trainer.batch import TrainBatch
from trainer.build import BatchPlan, Run
from trainer.data import PromptRecord
from trainer.rewards import Scores, check_reward_errors, reward_items, scores_of
from trainer.rollout.base import Rollout, SamplingParams, derived_seed
from trainer.tracking import timer
from trainer.workers.engines import KV_CACHE


class TrainingAborted(RuntimeError):
    """The run stopped on an error it cannot retry past; the message names the last usable checkpoint."""


# Sampling seeds: derived_seed(trainer.seed, step, round, PURPOSE), one per step and generation round,
# and validation's apart from training's (SeedSequence takes no negative round to mark it)
TRAINING, VALIDATION = 0, 1


@dataclass
class PromptGroup:
    """One prompt and its n rollouts with their rewards: the unit DAPO keeps or drops whole."""

    prompt: PromptRecord
    rollouts: list[Rollout] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)  # decoded, aligned with the rollouts
    scores: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    errors: int = 0  # samples the scorer could not score
    first_error: str | None = None

    def add(self, rollouts: list[Rollout], items: list[dict], scores: Scores) -> None:
        self.rollouts += rollouts
        self.responses += [item["response"] for item in items]
        self.scores += scores.scores.tolist()
        self.correct += scores.correct.tolist()
        self.errors += scores.errors
        self.first_error = self.first_error or scores.first_error

    def rewards_vary(self, metric: str) -> bool:
        """DAPO's keep predicate: not every reward equal (a group of one is kept, as verl does)."""
        values = self.correct if metric == "acc" else self.scores
        return len(values) < 2 or min(values) != max(values)


@dataclass
class Collected:
    """One step's training data: the padded batch and the groups it came from (in batch row order)."""

    batch: TrainBatch
    scores: Scores
    groups: list[PromptGroup]
    metrics: dict[str, float]


async def collect_batch(run: Run, step: int, timings: dict[str, float]) -> Collected:
    """Prompts -> rollouts -> scores, grouped by prompt; with DAPO dynamic sampling or
    multi_turn.tool_failure=drop_group, keep only the groups fit to train on (trainable_groups) and
    generate again until the batch is full."""
    plan, kept, rounds, errors, tool_batches = run.plan, [], 0, 0, []
    sampled, first_error, error_fraction = 0, None, 0.0
    async with rollout_phase(run, timings):
        while len(kept) < plan.prompts:
            rounds += 1
            if plan.group_filter and 0 < plan.group_filter.max_rounds < rounds:
                dropped = sum(b.dropped_groups for b in tool_batches)
                raise TrainingAborted(
                    f"dynamic sampling found only {len(kept)} of {plan.prompts} prompts with varying rewards "
                    f"in {plan.group_filter.max_rounds} generation rounds "
                    "(algorithm.filter_groups.max_num_gen_batches)"
                    + (f"; {dropped} groups were dropped for a failed tool call" if dropped else "")
                )
            sampling = dataclasses.replace(
                run.sampling, seed=derived_seed(run.cfg.trainer.seed, step, rounds, TRAINING)
            )
            with timer("data", timings):
                prompts = (await run.source.next_batch(plan.prompts_per_round)).prompts
            # a first round that trains on every group whatever its scores: padded while they are scored
            pad_now = rounds == 1 and plan.group_filter is None and not plan.drop_failed_tool_groups
            groups, tools, padded = await generate_groups(run, prompts, sampling, timings, pad=pad_now)
            errors += sum(g.errors for g in groups)
            sampled += sum(len(g.scores) for g in groups)
            first_error = first_error or next((g.first_error for g in groups if g.first_error), None)
            error_fraction = check_reward_errors(
                errors, sampled, run.cfg.reward_model.max_error_fraction, first_error
            )
            tool_batches += [tools] if tools is not None else []
            kept += trainable_groups(groups, plan, tools)[: plan.prompts - len(kept)]
    with timer("batch", timings):  # what padding was left after the scoring, if it ran beside it
        if padded is not None and len(kept) == len(groups):  # one round, kept whole: the batch padded early
            batch = await padded
        else:
            batch = padded_batch(run.pad_id, [(g.prompt, g.rollouts) for g in kept])
        scores = Scores(
            torch.tensor([s for g in kept for s in g.scores], dtype=torch.float32),
            torch.tensor([c for g in kept for c in g.correct], dtype=torch.float32),
            errors,
        )
    metrics = {
        "train/num_gen_batches": float(rounds),
        "reward/accuracy": float(scores.correct.mean()),
        "reward/errors": float(errors),
        "reward/error_fraction": error_fraction,
        "train/epoch": float(run.source.epoch),
    }
    if tool_batches:  # multi-turn: turns, tool calls and search errors of every trajectory generated
        metrics |= AgentBatch.merged(tool_batches).metrics()
    return Collected(batch, scores, kept, metrics)


def padded_batch(pad_id: int, groups: list[tuple[PromptRecord, list[Rollout]]]) -> TrainBatch:
    """The step's batch: each group's rollouts, re-indexed by the group's place (TrainBatch.group_ids)."""
    rollouts = [dataclasses.replace(r, prompt_index=i) for i, (_, group) in enumerate(groups) for r in group]
    return TrainBatch.from_rollouts(
        rollouts, pad_id, data_sources=[prompt.data_source for prompt, _ in groups]
    )


def trainable_groups(
    groups: list[PromptGroup], plan: BatchPlan, tools: AgentBatch | None
) -> list[PromptGroup]:
    """The groups of one round (in prompt order) that the step may train on: under
    multi_turn.tool_failure=drop_group not those with a failed tool call (the agent loop left them
    unscored), and with DAPO only those whose rewards vary.

    Dropped groups are refilled as DAPO's are, by another round (bounded by DAPO's max rounds where set;
    without DAPO each such round keeps a group, so it ends). A round that loses every group to failed
    tool calls stops the run instead, as a service error (the finished steps are saved): the clients'
    retries are spent, so the tools' services are down and another round would fail the same way. Under
    the other policies (text, retry) a round whose every tool call failed stops the run the same way:
    its trajectories would train on nothing but the failures' text."""
    if tools is not None and not plan.drop_failed_tool_groups:
        ran = sum(stats.calls - stats.invalid_calls for stats in tools.tools.values())
        failed_calls = sum(stats.errors for stats in tools.tools.values())
        if ran and failed_calls >= ran:
            failing = sorted(name for name, stats in tools.tools.items() if stats.errors)
            raise ServiceError(
                f"every one of the {ran} tool calls of a generation round failed (tools {failing}), after "
                "the clients' retries: their services are down"
            )
    if plan.drop_failed_tool_groups and tools is not None:
        failed = set(tools.failed_prompts)
        if failed and len(failed) == len(groups):
            failing = sorted(name for name, stats in tools.tools.items() if stats.errors)
            raise ServiceError(
                f"every one of the {len(groups)} prompt groups of a generation round had a tool call fail "
                f"(tools {failing}; multi_turn.tool_failure=drop_group drops them all)"
            )
        groups = [group for index, group in enumerate(groups) if index not in failed]
    if plan.group_filter:
        groups = [group for group in groups if group.rewards_vary(plan.group_filter.metric)]
    return groups


@asynccontextmanager
async def rollout_phase(run: Run, timings: dict[str, float]):
    """The colocated engines hold their KV caches only while rollouts are generated: the log-prob and
    update passes after it have that memory back (SGLang's release / resume of the "kv_cache" tag).
    With rollout.free_cache_engine=false they keep them from the first phase on (resume is then a no-op).
    timing_s/kv_memory: the resume and the release."""
    if not run.colocated:
        yield
        return
    with timer("kv_memory", timings):
        await run.rollout.resume_memory_async(KV_CACHE)
    free = run.cfg.actor_rollout_ref.rollout.free_cache_engine
    try:
        yield
    except BaseException:
        if free:  # the phase's own error is the one to report, not a release it left unable to run
            with contextlib.suppress(Exception):
                await run.rollout.release_memory_async(KV_CACHE)
        raise
    if free:
        with timer("kv_memory", timings):
            await run.rollout.release_memory_async(KV_CACHE)


async def generate_groups(
    run: Run,
    prompts: list[PromptRecord],
    sampling: SamplingParams,
    timings: dict[str, float],
    *,
    pad: bool = False,
) -> tuple[list[PromptGroup], AgentBatch | None, asyncio.Future[TrainBatch] | None]:
    """One generation round: n samples of every prompt, each prompt's group scored as soon as its samples
    are back (timing_s/gen: until the last sample; timing_s/reward: the scoring left after it). pad: the
    round's groups are the step's batch whatever their scores: it is padded on a thread while the last
    groups are scored, which a reward-server's answer or a tokenizer's decoding (both off the GIL) leave
    room for; the third value is that batch to come (else None)."""
    scoring = GroupScoring(run, [PromptGroup(prompt) for prompt in prompts])
    started = time.perf_counter()
    tools = await generate(run, [p.prompt_ids for p in prompts], sampling, scoring.add, timings)
    timings["gen"] = timings.get("gen", 0.0) + scoring.last_sample - started
    padded = None
    if pad and prompts and len(scoring.arrived) == len(prompts):
        rows = [(prompt, scoring.arrived[index]) for index, prompt in enumerate(prompts)]
        padded = asyncio.ensure_future(asyncio.to_thread(padded_batch, run.pad_id, rows))
    await scoring.finish()
    timings["reward"] = timings.get("reward", 0.0) + max(0.0, time.perf_counter() - scoring.last_sample)
    return scoring.groups, tools, padded


class GroupScoring:
    """Scores prompt groups as they come back, the ones that arrived together in one go: one decode of all
    their responses (a fast tokenizer's batch decode runs on every core, off the event loop) and one call
    of the scorer. A random or a length-capped model's groups all end at once; scored one by one, the
    driver's decoding grew with the GPU count (256 groups: ~0.6 s after the last sample, and the ranks
    idle). Groups that end apart are scored as they end, overlapped with the generation of the rest."""

    def __init__(self, run: Run, groups: list[PromptGroup]) -> None:
        self.run, self.groups = run, groups
        self.arrived: dict[int, list[Rollout]] = {}  # each group's rollouts as they came back
        self.last_sample = time.perf_counter()
        self._waiting: list[tuple[int, list[Rollout]]] = []
        self._scoring: asyncio.Task | None = None

    async def add(self, index: int, rollouts: list[Rollout]) -> None:
        """The on_group callback: prompt `index`'s rollouts are all back."""
        self.last_sample = time.perf_counter()
        self.arrived[index] = rollouts
        self._waiting.append((index, rollouts))
        if self._scoring is None or self._scoring.done():  # else the running scorer takes them next
            if self._scoring is not None:
                self._scoring.result()  # a scoring error stops the round here
            self._scoring = asyncio.ensure_future(self._score_waiting())

    async def finish(self) -> None:
        """Wait until every group added is scored (a scoring error is raised here)."""
        if self._scoring is not None:
            await self._scoring

    async def _score_waiting(self) -> None:
        while self._waiting:
            arrived, self._waiting = self._waiting, []
            prompts = {index: self.groups[index].prompt for index, _ in arrived}
            rollouts = [rollout for _, group in arrived for rollout in group]
            items = await asyncio.to_thread(reward_items, prompts, rollouts, self.run.tokenizer)
            results = await self.run.scorer.score(items, self.run.reward_options)
            start = 0
            for index, group in arrived:
                end = start + len(group)
                self.groups[index].add(group, items[start:end], scores_of(results[start:end]))
                start = end


async def generate(
    run: Run,
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    on_group: OnGroup,
    timings: dict[str, float],
) -> AgentBatch | None:
    """Every prompt's n rollouts through the rollout manager, each prompt's handed to on_group(index,
    rollouts) as soon as they are all back; with multi_turn.enable the agent loop's, which call tools as
    they go (timing_s/tool_calls: the wall time with a tool call in flight)."""
    if run.agent is None:

        async def one(index: int, prompt: list[int]) -> None:
            await on_group(index, await run.rollout.generate_async([prompt], sampling, first_index=index))

        requests = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompt_ids)]
        try:
            await asyncio.gather(*requests)
        except BaseException:  # a failed group (its scoring, its replicas) ends the round: abort the rest
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            raise
        return None
    tools = await run.agent.generate(prompt_ids, sampling, on_group=on_group)
    timings["tool_calls"] = timings.get("tool_calls", 0.0) + tools.tool_seconds
    return tools


def dump_rollouts(folder: str, step: int, groups: list[PromptGroup]) -> None:
    """trainer.rollout_data_dir: one JSON line per response (uid, score, text) in {folder}/{step}.jsonl."""
    path = Path(folder) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for group in groups:
            for response, score in zip(group.responses, group.scores):
                row = {"step": step, "uid": group.prompt.uid, "score": score, "response": response}
                out.write(json.dumps(row) + "\n")
