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
built once, with its settings, by trainer/build.py, so the step passes data only. A step's batch (the
generation rounds, the scoring as groups finish, DAPO's and drop_group's refills) is trainer/collect.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from services.common.client import ServiceError
from trainer import algos
from trainer.batch import TrainBatch
from trainer.collect import (
    VALIDATION,
    TrainingAborted,
    collect_batch,
    dump_rollouts,
    generate_groups,
    rollout_phase,
)
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
from trainer.profiling import profiled
from trainer.build import (
    AdvantageSettings,
    KLController,
    Run,
    build_run,
    close_run,
    seed_everything,
)
from trainer.packing import shared_prompt_tokens
from trainer.parallel.placement import WorkerGroupError
from trainer.rewards import RewardErrors, Scores, check_reward_errors
from trainer.rollout.base import derived_seed
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
        shared_tokens=shared_prompt_tokens(batch) if profile.shares_prompts else 0,
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
