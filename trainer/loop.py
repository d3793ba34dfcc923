"""The fit loop: on-policy RL for LLMs, the same driver for one CPU and for many GPUs on many nodes.

One step, whatever the algorithm:

    prompts    <- data-server or local files (cursor saved with every checkpoint)
    rollouts   <- the rollout manager: one request per prompt, to the policy ranks' engines (or SGLang
                  servers) as they have room; [multi_turn] the agent loop's trajectories call their
                  tools (retrieval-server, code-executor) between turns, each on one replica
    scores     <- each prompt's group scored as soon as its samples are back (reward-server over HTTP,
                  or the same scorers in-process), overlapped with the rest of the generation; the
                  groups that come back together are decoded and scored together
    [DAPO]        drop the groups whose rewards do not vary, generate again until full
    [drop_group]  drop the groups with a failed tool call (unscored), generate again until full
    old/ref logprobs, critic values                         (old logprobs skipped when exactly on-policy
                                                             and nothing else needs them)
    advantages <- trainer.algos (grpo | rloo | reinforce++ | reinforce++-baseline | gae)
    critic.update (gae), then policy.update after critic_warmup steps; the engines take the weights
    tracker.log(verl metric names); validate every test_freq; checkpoint every save_freq

The policy, reference and critic are role groups (trainer/parallel/groups.py): one rank in this process
or Ray ranks, called the same way. `fit` and `train_step` read top to bottom; every part they call was
built once, with its settings, by trainer/build.py, so the step passes data only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.common.client import ServiceError
from trainer import algos
from trainer.agent.loop import AgentBatch, OnGroup
from trainer.batch import TrainBatch
from trainer.checkpoint import (
    RoleState,
    TrainState,
    capture_rng_state,
    find_resume_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import Config
from trainer.config.derive import checkpoint_contents
from trainer.data import PromptRecord
from trainer.profiling import profiled
from trainer.build import (
    AdvantageSettings,
    BatchPlan,
    KLController,
    Run,
    build_run,
    close_run,
    seed_everything,
)
from trainer.parallel.placement import WorkerGroupError
from trainer.rewards import RewardErrors, Scores, check_reward_errors, reward_items, scores_of
from trainer.rollout.base import Rollout, SamplingParams, derived_seed
from trainer.workers.engines import KV_CACHE
from trainer.tracking import (
    Tracker,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    memory_metrics,
    mfu,
    peak_flops_per_gpu,
    progress_metrics,
    rollout_logprob_gap,
    timed,
    timer,
    training_flops,
)

log = logging.getLogger("trainer")


class TrainingAborted(RuntimeError):
    """The run stopped on an error it cannot retry past; the message names the last usable checkpoint."""


# Sampling seeds: derived_seed(trainer.seed, step, round, PURPOSE), one per step and generation round,
# and validation's apart from training's (SeedSequence takes no negative round to mark it)
TRAINING, VALIDATION = 0, 1


def fit(cfg: Config) -> dict[str, float]:
    """Train as configured; returns the last step's metrics (validation included)."""
    return asyncio.run(_fit(cfg))


async def _fit(cfg: Config) -> dict[str, float]:
    seed_everything(cfg.trainer.seed)
    run = await build_run(cfg)
    # What the build made (tokenizer, modules, clients: 548k objects on a 2-rank Ray driver with the Qwen
    # tokenizer) lives as long as the run: frozen, a full collection no longer walks it (0.35 s a time on a
    # 2-core CPU, landing on whichever step's allocations set it off).
    gc.collect()
    gc.freeze()
    try:
        return await train(run)
    finally:
        await close_run(run)


async def train(run: Run) -> dict[str, float]:
    """Resume, then step until the end; validation and checkpoints as configured."""
    cfg = run.cfg
    metrics: dict[str, float] = {}
    # updated: this step's train_step returned (its update is in the policy). after_done: the data cursor
    # and random streams right after the last step that finished, as a checkpoint of it would hold them.
    step, updated, after_done = 0, False, (None, None)
    try:
        step = await resume(run)
        if cfg.trainer.val_only or (cfg.trainer.val_before_train and step == 0):
            metrics = await validate(run, step)
            run.tracker.log(metrics, step)
            if cfg.trainer.val_only:
                return metrics
        while step < run.total_steps:
            step += 1
            updated, after_done = False, (run.source.state(), capture_rng_state())
            remote = [group for group in run.groups.all() if group.remote]
            with profiled(cfg.trainer.log_dir, step, cfg.trainer.profile_steps, remote):
                metrics = await train_step(run, step)
            # Validation draws from no global generator (its sampling is seeded), so this is what a save
            # after it holds.
            updated, after_done = True, (run.source.state(), capture_rng_state())
            if should(cfg.trainer.test_freq, step, run.total_steps):
                metrics |= await validate(run, step)
            # The row first, then the checkpoint (its time a row of its own, merged by step): a crash
            # between the two re-runs the step after a resume rather than leaving a saved step unlogged.
            run.tracker.log(metrics, step)
            if should(cfg.trainer.save_freq, step, run.total_steps):
                run.tracker.log(timed("save_checkpoint", save, run, step), step)
        return metrics
    except (ServiceError, RewardErrors) as exc:
        # A service that stays down, or rewards that cannot be computed (a scorer's outage comes back as
        # per-item errors): keep the finished steps, with the cursor and random streams from right after
        # the last of them.
        # A step that failed before its update changed no weights, but it may have fetched its prompts: it
        # is not finished, so a resumed run trains on that batch instead of skipping it. A step whose
        # validation failed is finished: its row is logged and it is saved as itself, else a resumed run
        # would train its batch a second time.
        if updated:
            run.tracker.log(metrics, step)
        done = step if updated else step - 1
        if done > run.last_saved_step:
            cursor, rng_state = after_done
            path = save(run, done, data_cursor=cursor, rng_state=rng_state)
        else:
            path = latest_checkpoint(checkpoint_root(cfg))
        what = f"a service stayed unreachable at step {step}: {exc}"
        if isinstance(exc, RewardErrors):
            what = f"{exc} (step {step})"
        raise TrainingAborted(f"{what}; last usable checkpoint: {path or 'none'}") from exc
    except WorkerGroupError as exc:
        # A rank died or failed and its group is shut down: nothing is left to save from.
        path = latest_checkpoint(checkpoint_root(cfg))
        raise TrainingAborted(
            f"{exc} (step {step}); last usable checkpoint: {path or 'none'}; "
            "restart with trainer.resume_mode=auto to continue from it"
        ) from exc


async def train_step(run: Run, step: int) -> dict[str, float]:
    timings: dict[str, float] = {}
    with timer("step", timings):
        collected = await collect_batch(run, step, timings)
        batch = collected.batch
        if run.needs_old_logprobs:
            with timer("old_log_prob", timings):
                batch = batch.with_fields(old_logprobs=run.policy.compute_logprobs(batch).logprobs)
        if run.reference is not None:
            with timer("ref", timings):
                batch = batch.with_fields(ref_logprobs=run.reference.compute_logprobs(batch))
        if run.critic is not None:
            with timer("values", timings):
                batch = batch.with_fields(values=run.critic.compute_values(batch))
        with timer("adv", timings):
            batch, metrics = compute_advantages(batch, collected.scores.scores, run.advantage, run.kl_ctrl)
        if warning := no_signal_warning(batch.advantages, collected.scores.scores, step):
            log.warning(warning)
        if batch.old_logprobs is not None:  # the engine's logprobs vs the trainer's (verl's names)
            metrics |= rollout_logprob_gap(batch.rollout_logprobs, batch.old_logprobs, batch.response_mask)
        if run.critic is not None:
            with timer("update_critic", timings):
                metrics |= run.critic.update(batch)
        if step > run.cfg.trainer.critic_warmup:
            with timer("update_actor", timings):
                metrics |= run.policy.update(batch)
            with timer("update_weights", timings):
                await run.sync_weights()
    if run.cfg.trainer.rollout_data_dir:
        dump_rollouts(run.cfg.trainer.rollout_data_dir, step, collected.groups)
    progress = progress_metrics(step, run.source.epoch)
    return metrics | collected.metrics | step_metrics(run, batch, collected.scores, timings) | progress


# ------------------------------------------------------------------------------------------ a batch


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


# ------------------------------------------------------------------------------------------ advantages


def compute_advantages(
    batch: TrainBatch, scores: torch.Tensor, settings: AdvantageSettings, kl_ctrl: KLController
) -> tuple[TrainBatch, dict[str, float]]:
    """Token rewards (score on the last token, minus KL when in the reward) -> advantages, returns.

    The outcome estimators see each response's own score (minus its summed KL penalty), also for a
    response with no loss tokens, whose token rewards are all 0 (see trainer/algos.py).
    """
    mask = batch.response_mask
    token_scores = algos.scores_to_token_rewards(scores, mask)
    token_rewards, outcome, metrics = token_scores, scores, {}
    if settings.use_kl_in_reward:
        token_rewards, seq_kl = algos.apply_kl_in_reward(
            token_scores,
            batch.old_logprobs,
            batch.ref_logprobs,
            mask,
            kl_coef=kl_ctrl.value,
            kind=settings.kl_penalty,
        )
        outcome = scores + (token_rewards - token_scores).sum(dim=-1)  # minus the summed KL penalty
        metrics = {
            "actor/reward_kl_penalty": float(seq_kl.mean()),
            "actor/reward_kl_penalty_coeff": kl_ctrl.value,
        }
        kl_ctrl.update(float(seq_kl.mean()), n_steps=len(batch))
    estimator, groups = settings.estimator, batch.group_ids
    if estimator == "gae":
        advantages, returns = algos.gae_advantages(
            token_rewards, batch.values, mask, gamma=settings.gamma, lam=settings.lam
        )
        return batch.with_fields(token_scores=token_scores, advantages=advantages, returns=returns), metrics
    if estimator == "grpo":
        advantages = algos.grpo_advantages(outcome, groups, mask, norm_by_std=settings.norm_by_std)
    elif estimator == "rloo":
        advantages = algos.rloo_advantages(outcome, groups, mask)
    elif estimator == "reinforce_plus_plus":
        advantages = algos.reinforce_plus_plus_advantages(token_rewards, mask, gamma=settings.gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = algos.reinforce_plus_plus_baseline_advantages(outcome, groups, mask)
    else:
        raise ValueError(f"unknown algorithm.adv_estimator {estimator!r}")
    return batch.with_fields(token_scores=token_scores, advantages=advantages, returns=advantages), metrics


def no_signal_warning(advantages: torch.Tensor, scores: torch.Tensor, step: int) -> str | None:
    """A step whose advantages are all 0 learns nothing from its rewards, and nothing else says so: the
    metrics just read 0. A reward that cannot vary (ground truths in a format the scorer does not read, a
    parser that never matches) looks like this on every step; a healthy run, on the odd step at most."""
    if advantages.any():
        return None
    return (
        f"step {step}: every advantage is 0 (every prompt's samples scored alike; mean score "
        f"{float(scores.mean()):.3g}), so the rewards gave this update no signal: if this repeats, check "
        "that the reward can vary (the ground truths' format, the answer parser)"
    )


# ------------------------------------------------------------------------------------------ metrics


def step_metrics(run: Run, batch: TrainBatch, scores: Scores, timings: dict[str, float]) -> dict[str, float]:
    cfg = run.cfg
    prompt_tokens, response_tokens = int(batch.prompt_lengths.sum()), int(batch.response_lengths.sum())
    metrics = compute_data_metrics(
        scores=scores.scores,
        advantages=batch.advantages,
        response_mask=batch.response_mask,
        response_lengths=batch.response_mask.sum(dim=-1),  # the model's tokens: tool output is not counted
        total_response_lengths=batch.response_lengths,
        prompt_lengths=batch.prompt_lengths,
        max_response_length=cfg.actor_rollout_ref.rollout.response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        token_rewards=batch.token_scores,
        returns=batch.returns if run.critic else None,
        values=batch.values,
    )
    metrics |= compute_timing_metrics(
        timings, num_prompt_tokens=prompt_tokens, num_response_tokens=response_tokens
    )
    metrics |= compute_throughput_metrics(prompt_tokens + response_tokens, timings["step"], run.world_size)
    profile = run.profile
    flops = training_flops(
        num_params=profile.num_params,
        seq_lens=(batch.prompt_lengths + batch.response_lengths).tolist(),
        num_layers=profile.num_layers,
        attention_dim=profile.hidden_size,
    )
    utilisation = mfu(
        flops * profile.ppo_epochs,
        timings.get("update_actor", 0.0),
        n_gpus=run.world_size,
        peak_flops_per_gpu=peak_flops_per_gpu(profile.device_name) if profile.device_name else None,
    )
    if utilisation is not None:
        metrics["perf/mfu/actor"] = utilisation
    return metrics | memory_metrics()


# ------------------------------------------------------------------------------------------ validation


async def validate(run: Run, step: int) -> dict[str, float]:
    """val-core/{data_source}/acc/mean@n (greedy by default) over the validation split."""
    cfg, n, started = run.cfg, run.val_sampling.n, time.perf_counter()
    correct: dict[str, list[float]] = defaultdict(list)
    rewards: dict[str, list[float]] = defaultdict(list)
    samples: list[dict] = []
    dropped, errors, scored, first_error = 0, 0, 0, None
    sampling = dataclasses.replace(run.val_sampling, seed=derived_seed(cfg.trainer.seed, step, 0, VALIDATION))
    async with rollout_phase(run, {}):
        async for batch in run.source.validation_batches(cfg.data.val_batch_size):
            groups, _, _ = await generate_groups(run, batch.prompts, sampling, {})
            for group in groups:
                if not group.rollouts:  # dropped for a failed tool call (drop_group): cut short, unscored
                    dropped += 1
                    continue
                source = group.prompt.data_source
                correct[source] += group.correct
                rewards[source] += group.scores
                errors, scored = errors + group.errors, scored + len(group.scores)
                first_error = first_error or group.first_error
                for response, score in zip(group.responses, group.scores):
                    if len(samples) < cfg.trainer.log_val_generations:
                        prompt = run.tokenizer.decode(group.prompt.prompt_ids, skip_special_tokens=True)
                        samples.append({"input": prompt, "output": response, "score": score})
    # A validation of uncomputable rewards would report an accuracy of 0 as if measured: the same stop
    # as a training round's
    error_fraction = check_reward_errors(errors, scored, cfg.reward_model.max_error_fraction, first_error)
    if samples:
        run.tracker.log_generations(samples, step)
    metrics = {"val-aux/reward/error_fraction": error_fraction} if errors else {}
    for source, right in correct.items():
        metrics[f"val-core/{source}/acc/mean@{n}"] = float(np.mean(right))
        metrics[f"val-aux/{source}/reward/mean@{n}"] = float(np.mean(rewards[source]))
    if dropped:
        metrics["val-aux/tool/dropped_groups"] = float(dropped)
    return metrics | {"timing_s/testing": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------ checkpoints


async def resume(run: Run) -> int:
    """Restore the latest (or named) checkpoint, open the tracker (same run id), return the last done step."""
    cfg = run.cfg
    path = find_resume_checkpoint(checkpoint_root(cfg), cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
    state = TrainState(step=0)
    if path is not None:
        state = load_checkpoint(path, roles=checkpoint_roles(run), contents=checkpoint_contents(cfg, "load"))
        run.source.restore(state.data_cursor)
        run.kl_ctrl.value = state.extra.get("kl_coef", run.kl_ctrl.value)
        run.last_saved_step = state.step
        # the engines were built from model.path: they must sample the resumed policy
        await run.sync_weights()
        print(f"resumed from {path} (step {state.step})", flush=True)
    run.tracker = Tracker(
        cfg.trainer.logger,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        run_dir=Path(cfg.trainer.log_dir),
        config=cfg.to_dict(),
        total_steps=run.total_steps,
        run_id=state.tracker_run_id,
        start_step=state.step,
    )
    return state.step


def save(run: Run, step: int, data_cursor: str | None = None, rng_state: dict | None = None) -> Path:
    """Checkpoint after `step`; data_cursor and rng_state: as they were before the step that follows it
    (now, unless a failed step already advanced them)."""
    cursor = data_cursor if data_cursor is not None else run.source.state()
    state = TrainState(
        step=step,
        data_cursor=cursor,
        tracker_run_id=run.tracker.run_id,
        extra={"kl_coef": run.kl_ctrl.value},
        rng_state=rng_state if rng_state is not None else capture_rng_state(),
    )
    path = save_checkpoint(
        checkpoint_root(run.cfg),
        step,
        roles=checkpoint_roles(run),
        state=state,
        keep_last=run.cfg.trainer.max_actor_ckpt_to_keep,
        contents=checkpoint_contents(run.cfg, "save"),
    )
    run.last_saved_step = step
    return path


def checkpoint_roles(run: Run) -> dict[str, RoleState]:
    """The trained roles by checkpoint directory: each role group saves itself, rank by rank."""
    return {"actor": run.policy, **({"critic": run.critic} if run.critic is not None else {})}


def should(freq: int, step: int, last: int) -> bool:
    """Every `freq` steps and at the last one; never when freq <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.trainer.default_local_dir)
