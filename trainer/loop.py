"""The fit loop: on-policy RL for LLMs, one process (CPU or one GPU).

One step, whatever the algorithm:

    prompts   <- data-server or local files (cursor saved with every checkpoint)
    rollouts  <- engine.generate(prompts, n)                 built-in engine, colocated with the policy
    scores    <- reward-server (HTTP, batched, retried) or the same scorers in-process
    [DAPO]       drop groups whose scores do not vary, fetch more prompts until the batch is full
    old/ref logprobs, critic values                         (old logprobs skipped when exactly on-policy)
    advantages <- trainer.algos (grpo | rloo | reinforce++ | reinforce++-baseline | gae)
    critic.update (gae), then policy.update after critic_warmup steps
    tracker.log(verl metric names); validate every test_freq; checkpoint every save_freq

The loop itself (`fit`, `train_step`) reads top to bottom; building the parts, collecting a batch,
advantages, validation and checkpoints are the small functions below it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.client import ServiceError
from services.reward_server.schemas import RewardOptions
from trainer import algos
from trainer.batch import TrainBatch
from trainer.checkpoint import (
    TrainState,
    find_resume_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_train_state,
    save_checkpoint,
)
from trainer.config import Config
from trainer.data import PromptRecord, open_prompt_source, total_steps
from trainer.model import default_precision, load_critic, load_policy, load_reference, load_tokenizer
from trainer.rewards import Scores, close_scorer, open_scorer, reward_items, reward_options, score_rollouts
from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.hf_engine import HFRolloutEngine
from trainer.tracking import (
    Tracker,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    memory_metrics,
    mfu,
    peak_flops_per_gpu,
    progress_metrics,
    timed,
    timer,
    training_flops,
)
from trainer.workers.actor import OptimizerSettings, Policy, PolicyLossSettings, is_on_policy
from trainer.workers.critic import Critic, ValueLossSettings
from trainer.workers.reference import Reference

log = logging.getLogger("trainer")


class TrainingAborted(RuntimeError):
    """The run stopped on an error it cannot retry past; the message names the last usable checkpoint."""


@dataclass
class Run:
    """Everything a run builds once."""

    cfg: Config
    tokenizer: object
    source: object  # trainer.data.PromptSource
    engine: HFRolloutEngine
    policy: Policy
    reference: Reference | None
    critic: Critic | None
    scorer: object  # trainer.rewards.Scorer
    tracker: Tracker | None
    kl_ctrl: algos.FixedKLController | algos.AdaptiveKLController
    total_steps: int
    sampling: SamplingParams
    val_sampling: SamplingParams
    reward_options: RewardOptions
    last_saved_step: int = 0


def fit(cfg: Config) -> dict[str, float]:
    """Train as configured; returns the last step's metrics (validation included)."""
    return asyncio.run(_fit(cfg))


async def _fit(cfg: Config) -> dict[str, float]:
    seed_everything(cfg.trainer.seed)
    run = await build_run(cfg)
    metrics: dict[str, float] = {}
    step, cursor_before_step = 0, None
    try:
        step = resume(run)
        if cfg.trainer.val_only or (cfg.trainer.val_before_train and step == 0):
            metrics = await validate(run, step)
            run.tracker.log(metrics, step)
            if cfg.trainer.val_only:
                return metrics
        while step < run.total_steps:
            step += 1
            cursor_before_step = run.source.state()
            metrics = await train_step(run, step)
            if should(cfg.trainer.test_freq, step, run.total_steps):
                metrics |= await validate(run, step)
            if should(cfg.trainer.save_freq, step, run.total_steps):
                metrics |= timed("save_checkpoint", save, run, step)
            run.tracker.log(metrics, step)
        return metrics
    except ServiceError as exc:
        # Keep the finished steps. The failed step changed no weights, but it may have fetched its prompts:
        # save the cursor from before it, so a resumed run trains on that batch instead of skipping it.
        if step - 1 > run.last_saved_step:
            path = save(run, step - 1, data_cursor=cursor_before_step)
        else:
            path = latest_checkpoint(checkpoint_root(cfg))
        raise TrainingAborted(
            f"a service stayed unreachable at step {step}: {exc}; last usable checkpoint: {path or 'none'}"
        ) from exc
    finally:
        await close_run(run)


async def train_step(run: Run, step: int) -> dict[str, float]:
    cfg, timings = run.cfg, {}
    actor, rollout, algo = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    temperature = rollout.temperature or 1.0
    n = rollout.n  # verl's mini-batch sizes count prompts; the workers count sequences (prompts x n)
    with timer("step", timings):
        collected = await collect_batch(run, timings)
        batch, scores = collected.batch, collected.scores
        on_policy = is_on_policy(len(batch), actor.ppo_mini_batch_size * n, actor.ppo_epochs)
        if not on_policy:
            with timer("old_log_prob", timings):
                old = run.policy.compute_logprobs(
                    batch, rollout.log_prob_micro_batch_size_per_gpu, temperature=temperature
                )
                batch = batch.with_fields(old_logprobs=old.logprobs)
        if run.reference is not None:
            with timer("ref", timings):
                ref = run.reference.compute_logprobs(
                    batch,
                    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                    temperature=temperature,
                )
                batch = batch.with_fields(ref_logprobs=ref)
        if run.critic is not None:
            with timer("values", timings):
                batch = batch.with_fields(
                    values=run.critic.compute_values(batch, cfg.critic.forward_micro_batch_size_per_gpu)
                )
        with timer("adv", timings):
            batch, metrics = compute_advantages(batch, scores.scores, algo, run.kl_ctrl)
        if run.critic is not None:
            with timer("update_critic", timings):
                metrics |= run.critic.update(
                    batch,
                    mini_batch_size=cfg.critic.ppo_mini_batch_size * n,
                    micro_batch_size=cfg.critic.ppo_micro_batch_size_per_gpu,
                    ppo_epochs=cfg.critic.ppo_epochs,
                    loss=ValueLossSettings(
                        cliprange_value=cfg.critic.cliprange_value,
                        loss_agg_mode=cfg.critic.loss_agg_mode,
                        max_response_len=cfg.data.max_response_length,
                    ),
                )
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor", timings):
                metrics |= run.policy.update(
                    batch,
                    mini_batch_size=actor.ppo_mini_batch_size * n,
                    micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
                    ppo_epochs=actor.ppo_epochs,
                    loss=policy_loss_settings(cfg),
                    temperature=temperature,
                )
            run.engine.load_weights(run.policy.model)  # colocated: the same module, nothing to copy
    if cfg.trainer.rollout_data_dir:
        dump_rollouts(cfg.trainer.rollout_data_dir, step, collected, rollout.n)
    progress = progress_metrics(step, run.source.epoch)
    return metrics | collected.metrics | step_metrics(run, batch, scores, timings) | progress


# ------------------------------------------------------------------------------------------ a batch


@dataclass
class Collected:
    """One step's training data: the padded batch and what it came from."""

    batch: TrainBatch
    scores: Scores
    prompts: list[PromptRecord]
    responses: list[str]  # decoded, aligned with the batch rows
    metrics: dict[str, float]


async def collect_batch(run: Run, timings: dict[str, float]) -> Collected:
    """Prompts -> rollouts -> scores; with DAPO dynamic sampling, refill until the batch is full."""
    cfg = run.cfg
    groups = cfg.algorithm.filter_groups
    want, n = cfg.data.train_batch_size, run.sampling.n
    prompts: list[PromptRecord] = []
    rollouts: list[Rollout] = []
    score_parts: list[Scores] = []
    responses: list[str] = []
    rounds = 0
    while len(prompts) < want:
        rounds += 1
        if groups.enable and 0 < groups.max_num_gen_batches < rounds:
            raise TrainingAborted(
                f"dynamic sampling found only {len(prompts)} of {want} prompts with varying rewards in "
                f"{groups.max_num_gen_batches} generation rounds "
                "(algorithm.filter_groups.max_num_gen_batches)"
            )
        fetched = await run.source.next_batch(cfg.data.gen_batch_size if groups.enable else want)
        with timer("gen", timings):
            new = run.engine.generate([p.prompt_ids for p in fetched.prompts], run.sampling)
        with timer("reward", timings):
            items = reward_items(fetched.prompts, new, run.tokenizer)
            scores = await score_rollouts(run.scorer, items, run.reward_options)
        keep = list(range(len(fetched.prompts)))
        if groups.enable:
            metric = scores.correct if groups.metric == "acc" else scores.scores
            flat = algos.zero_variance_groups(metric, torch.tensor([r.prompt_index for r in new]))
            keep = [i for i in keep if not bool(flat[i * n])][: want - len(prompts)]
        rows = [row for i in keep for row in range(i * n, (i + 1) * n)]
        offset = len(prompts)
        prompts += [fetched.prompts[i] for i in keep]
        rollouts += [
            dataclasses.replace(new[row], prompt_index=offset + keep.index(new[row].prompt_index))
            for row in rows
        ]
        score_parts.append(Scores(scores.scores[rows], scores.correct[rows], scores.errors))
        responses += [items[row]["response"] for row in rows]
    batch = TrainBatch.from_rollouts(
        rollouts, run.engine.pad_id, data_sources=[p.data_source for p in prompts]
    )
    scores = Scores(
        torch.cat([s.scores for s in score_parts]),
        torch.cat([s.correct for s in score_parts]),
        sum(s.errors for s in score_parts),
    )
    metrics = {
        "train/num_gen_batches": float(rounds),
        "reward/accuracy": float(scores.correct.mean()),
        "reward/errors": float(scores.errors),
        "train/epoch": float(run.source.epoch),
    }
    return Collected(batch, scores, prompts, responses, metrics)


def dump_rollouts(folder: str, step: int, collected: Collected, n: int) -> None:
    """trainer.rollout_data_dir: one JSON line per response (uid, score, text) in {folder}/{step}.jsonl."""
    path = Path(folder) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for row, (response, score) in enumerate(zip(collected.responses, collected.scores.scores.tolist())):
            prompt = collected.prompts[row // n]
            out.write(
                json.dumps({"step": step, "uid": prompt.uid, "score": score, "response": response}) + "\n"
            )


def compute_advantages(batch: TrainBatch, scores: torch.Tensor, algo, kl_ctrl) -> tuple[TrainBatch, dict]:
    """Token rewards (score on the last token, minus KL when in the reward) -> advantages, returns."""
    mask = batch.response_mask
    token_scores = algos.scores_to_token_rewards(scores, mask)
    token_rewards, metrics = token_scores, {}
    if algo.use_kl_in_reward:
        token_rewards, seq_kl = algos.apply_kl_in_reward(
            token_scores,
            batch.old_logprobs,
            batch.ref_logprobs,
            mask,
            kl_coef=kl_ctrl.value,
            kind=algo.kl_penalty,
        )
        metrics = {
            "actor/reward_kl_penalty": float(seq_kl.mean()),
            "actor/reward_kl_penalty_coeff": kl_ctrl.value,
        }
        kl_ctrl.update(float(seq_kl.mean()), n_steps=len(batch))
    outcome = token_rewards.sum(dim=-1)  # the score, minus the summed KL when it is in the reward
    estimator = algo.adv_estimator
    if estimator == "gae":
        advantages, returns = algos.gae_advantages(
            token_rewards, batch.values, mask, gamma=algo.gamma, lam=algo.lam
        )
    else:
        if estimator == "grpo":
            advantages = algos.grpo_advantages(
                outcome, batch.group_ids, mask, norm_by_std=algo.norm_adv_by_std_in_grpo
            )
        elif estimator == "rloo":
            advantages = algos.rloo_advantages(outcome, batch.group_ids, mask)
        elif estimator == "reinforce_plus_plus":
            advantages = algos.reinforce_plus_plus_advantages(token_rewards, mask, gamma=algo.gamma)
        elif estimator == "reinforce_plus_plus_baseline":
            advantages = algos.reinforce_plus_plus_baseline_advantages(outcome, batch.group_ids, mask)
        else:
            raise ValueError(f"unknown algorithm.adv_estimator {estimator!r}")
        returns = advantages
    return batch.with_fields(token_scores=token_scores, advantages=advantages, returns=returns), metrics


def step_metrics(run: Run, batch: TrainBatch, scores: Scores, timings: dict[str, float]) -> dict[str, float]:
    cfg = run.cfg
    prompt_tokens, response_tokens = int(batch.prompt_lengths.sum()), int(batch.response_lengths.sum())
    token_rewards = batch.token_scores if batch.token_scores is not None else None
    metrics = compute_data_metrics(
        scores=scores.scores,
        advantages=batch.advantages,
        response_mask=batch.response_mask,
        response_lengths=batch.response_lengths,
        prompt_lengths=batch.prompt_lengths,
        max_response_length=cfg.data.max_response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        token_rewards=token_rewards,
        returns=batch.returns if run.critic else None,
        values=batch.values,
    )
    metrics |= compute_timing_metrics(
        timings, num_prompt_tokens=prompt_tokens, num_response_tokens=response_tokens
    )
    metrics |= compute_throughput_metrics(prompt_tokens + response_tokens, timings["step"], cfg.world_size)
    model_config = run.policy.model.config
    flops = (
        training_flops(
            num_params=sum(p.numel() for p in run.policy.model.parameters()),
            seq_lens=(batch.prompt_lengths + batch.response_lengths).tolist(),
            num_layers=model_config.num_hidden_layers,
            attention_dim=model_config.hidden_size,
        )
        * cfg.actor_rollout_ref.actor.ppo_epochs
    )
    utilisation = mfu(
        flops,
        timings.get("update_actor", 0.0),
        n_gpus=cfg.world_size,
        peak_flops_per_gpu=peak_flops_per_gpu() if run.policy.device.type == "cuda" else None,
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
    async for batch in run.source.validation_batches(cfg.data.val_batch_size):
        rollouts = run.engine.generate([p.prompt_ids for p in batch.prompts], run.val_sampling)
        items = reward_items(batch.prompts, rollouts, run.tokenizer)
        scored = await score_rollouts(run.scorer, items, run.reward_options)
        for rollout, item, score, right in zip(
            rollouts, items, scored.scores.tolist(), scored.correct.tolist()
        ):
            correct[item["data_source"]].append(right)
            rewards[item["data_source"]].append(score)
            if len(samples) < cfg.trainer.log_val_generations:
                prompt = run.tokenizer.decode(
                    batch.prompts[rollout.prompt_index].prompt_ids, skip_special_tokens=True
                )
                samples.append({"input": prompt, "output": item["response"], "score": score})
    if samples:
        run.tracker.log_generations(samples, step)
    metrics = {}
    for source, right in correct.items():
        metrics[f"val-core/{source}/acc/mean@{n}"] = float(np.mean(right))
        metrics[f"val-aux/{source}/reward/mean@{n}"] = float(np.mean(rewards[source]))
    return metrics | {"timing_s/testing": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------ building


async def build_run(cfg: Config) -> Run:
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    device = resolve_device(trainer.device)
    precision = default_precision(device, trainer.mixed_precision)
    tokenizer = load_tokenizer(
        cfg.data.tokenizer or arr.model.path, trust_remote_code=arr.model.trust_remote_code
    )
    model = load_policy(
        arr.model.path,
        device=device,
        param_dtype=precision.param_dtype,
        trust_remote_code=arr.model.trust_remote_code,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
    )
    source = await open_prompt_source(
        cfg.data, cfg.services, tokenizer, chat_template=arr.model.custom_chat_template
    )
    steps = total_steps(
        source.train_size, cfg.data.train_batch_size, trainer.total_epochs, trainer.total_training_steps
    )
    policy = Policy(
        model,
        optimizer_settings(arr.actor.optim, arr.actor.grad_clip, steps),
        autocast_dtype=precision.autocast_dtype,
    )
    reference = critic = None
    if cfg.use_reference:
        reference = Reference(
            load_reference(
                arr.model.path,
                device=device,
                param_dtype=precision.param_dtype,
                trust_remote_code=arr.model.trust_remote_code,
            ),
            autocast_dtype=precision.autocast_dtype,
        )
    if cfg.use_critic:
        critic_model = load_critic(
            cfg.critic.model.path,
            device=device,
            param_dtype=precision.param_dtype,
            trust_remote_code=bool(cfg.critic.model.trust_remote_code),
            gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
        )
        critic = Critic(
            critic_model,
            optimizer_settings(cfg.critic.optim, cfg.critic.grad_clip, steps),
            autocast_dtype=precision.autocast_dtype,
        )
    scorer = await open_scorer(
        cfg.reward_model.mode,
        urls=cfg.services.reward_url,
        timeout_s=cfg.services.timeout_s,
        retries=cfg.services.retries,
        token=cfg.services.auth_token,
        health_timeout_s=cfg.services.health_timeout_s,
        custom_path=cfg.custom_reward_function.path,
        custom_name=cfg.custom_reward_function.name,
    )
    run = Run(
        cfg=cfg,
        tokenizer=tokenizer,
        source=source,
        engine=HFRolloutEngine(model, tokenizer, autocast_dtype=precision.autocast_dtype),
        policy=policy,
        reference=reference,
        critic=critic,
        scorer=scorer,
        tracker=None,
        kl_ctrl=kl_controller(cfg.algorithm.kl_ctrl),
        total_steps=steps,
        sampling=sampling_params(arr.rollout, cfg.data.max_response_length, validation=False),
        val_sampling=sampling_params(arr.rollout, cfg.data.max_response_length, validation=True),
        reward_options=reward_options(cfg.reward_model, cfg.data.max_response_length),
    )
    return run


def resume(run: Run) -> int:
    """Restore the latest (or named) checkpoint, open the tracker (same run id), return the last done step."""
    cfg = run.cfg
    path = find_resume_checkpoint(checkpoint_root(cfg), cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
    state = load_train_state(path) if path is not None else TrainState(step=0)
    if path is not None:
        models, optimizers, schedulers = checkpoint_parts(run)
        state = load_checkpoint(path, models=models, optimizers=optimizers, schedulers=schedulers)
        run.source.restore(state.data_cursor)
        run.kl_ctrl.value = state.extra.get("kl_coef", run.kl_ctrl.value)
        run.last_saved_step = state.step
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


def save(run: Run, step: int, data_cursor: str | None = None) -> Path:
    models, optimizers, schedulers = checkpoint_parts(run)
    cursor = data_cursor if data_cursor is not None else run.source.state()
    state = TrainState(
        step=step, data_cursor=cursor, tracker_run_id=run.tracker.run_id, extra={"kl_coef": run.kl_ctrl.value}
    )
    path = save_checkpoint(
        checkpoint_root(run.cfg),
        step,
        models=models,
        optimizers=optimizers,
        schedulers=schedulers,
        state=state,
        keep_last=run.cfg.trainer.max_actor_ckpt_to_keep,
        tokenizer=run.tokenizer,
    )
    run.last_saved_step = step
    return path


def checkpoint_parts(run: Run) -> tuple[dict, dict, dict]:
    workers = {"actor": run.policy, **({"critic": run.critic} if run.critic is not None else {})}
    return (
        {role: w.model for role, w in workers.items()},
        {role: w.optimizer for role, w in workers.items()},
        {role: w.scheduler for role, w in workers.items()},
    )


async def close_run(run: Run) -> None:
    if run.tracker is not None:
        run.tracker.close()
    await close_scorer(run.scorer)
    await run.source.aclose()


# ------------------------------------------------------------------------------------------ small pieces


def should(freq: int, step: int, last: int) -> bool:
    """Every `freq` steps and at the last one; never when freq <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.trainer.default_local_dir)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def optimizer_settings(optim, grad_clip: float, steps: int) -> OptimizerSettings:
    warmup = (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps is not None and optim.lr_warmup_steps >= 0
        else int(optim.lr_warmup_steps_ratio * steps)
    )
    return OptimizerSettings(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        grad_clip=grad_clip,
        warmup_steps=warmup,
        total_steps=steps,
        schedule=optim.lr_scheduler_type,
        min_lr_ratio=optim.min_lr_ratio or 0.0,
    )


def policy_loss_settings(cfg: Config) -> PolicyLossSettings:
    actor = cfg.actor_rollout_ref.actor
    return PolicyLossSettings(
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        max_response_len=actor.loss_scale_factor,
    )


def sampling_params(rollout, max_response_length: int, *, validation: bool) -> SamplingParams:
    if validation:
        kw = rollout.val_kwargs
        greedy = not kw.do_sample or kw.temperature == 0
        return SamplingParams(
            temperature=0.0 if greedy else kw.temperature,
            top_p=kw.top_p,
            top_k=kw.top_k,
            max_new_tokens=max_response_length,
            stop=tuple(rollout.stop),
            stop_token_ids=tuple(rollout.stop_token_ids),
            n=kw.n,
        )
    return SamplingParams(
        temperature=rollout.temperature if rollout.do_sample else 0.0,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=max_response_length,
        stop=tuple(rollout.stop),
        stop_token_ids=tuple(rollout.stop_token_ids),
        n=rollout.n,
    )


def kl_controller(kl_ctrl) -> algos.FixedKLController | algos.AdaptiveKLController:
    if kl_ctrl.type == "adaptive":
        return algos.AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    return algos.FixedKLController(kl_ctrl.kl_coef)


def main() -> None:  # pragma: no cover - `python -m trainer.main_ppo` is the entry point
    sys.exit("run `python -m trainer.main_ppo key=value ...`")
