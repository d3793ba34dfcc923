"""Everything a run builds once, from the config: the parts the fit loop drives, each with its settings.

`build_run(cfg)` loads the models and opens the prompt source and the scorer, and turns the config's
keys into each part's settings here, once: the policy, reference and critic get their batch sizes,
losses and temperature at construction, so a training step passes them data only
(`run.policy.update(batch)`). verl's batch sizes count prompts; every size handed to a worker counts
sequences (prompts x rollout.n).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from services.reward_server.schemas import RewardOptions
from trainer import algos
from trainer.agent.build import agent_tools, build_agent, chat_template_tools
from trainer.agent.loop import AgentLoop
from trainer.algos import KLKind
from trainer.config import Config
from trainer.compiling import compile_model
from trainer.data import PromptSource, open_prompt_source, total_steps
from trainer.model import (
    Precision,
    default_precision,
    load_critic,
    load_policy,
    load_reference,
    load_tokenizer,
)
from trainer.rewards import Scorer, close_scorer, open_scorer, reward_options
from trainer.packing import use_packed_attention
from trainer.rollout.base import RolloutEngine, SamplingParams
from trainer.rollout.factory import build_rollout, server_urls_from_env, visible_gpus
from trainer.tracking import Tracker
from trainer.workers.actor import Policy, PolicyLossSettings
from trainer.workers.common import MicroBatchSize, OptimizerSettings, TokenBudget, UpdateSettings
from trainer.workers.critic import Critic, ValueLossSettings
from trainer.workers.engines import builtin_engine
from trainer.workers.group import GroupWeights, PolicyProfile
from trainer.workers.logprobs import LogprobHead
from trainer.workers.reference import Reference

if TYPE_CHECKING:
    from trainer.cluster import Groups

log = logging.getLogger("trainer")

KLController = algos.FixedKLController | algos.AdaptiveKLController


@dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
    """algorithm.*: how token rewards and advantages are computed from the scores."""

    estimator: str  # grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae
    gamma: float
    lam: float
    norm_by_std: bool  # GRPO (true) or Dr. GRPO (false)
    use_kl_in_reward: bool
    kl_penalty: KLKind


@dataclass(frozen=True, kw_only=True)
class GroupFilter:
    """DAPO dynamic sampling: keep only prompts whose n rewards vary (algorithm.filter_groups)."""

    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"]  # acc: correctness, else the score
    max_rounds: int  # generation rounds per step before giving up; <= 0: no limit


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How many prompts a step trains on and how many each generation round fetches."""

    prompts: int  # data.train_batch_size
    prompts_per_round: int  # data.gen_batch_size with DAPO, else prompts
    group_filter: GroupFilter | None


@dataclass
class Run:
    """Everything a run builds once; the loop reads its parts and passes them data."""

    cfg: Config  # trainer.* (frequencies, folders, logger) for the driver itself
    tokenizer: PreTrainedTokenizerBase
    source: PromptSource
    engine: RolloutEngine
    scorer: Scorer
    policy: Policy
    reference: Reference | None
    critic: Critic | None
    kl_ctrl: KLController
    advantage: AdvantageSettings
    plan: BatchPlan
    sampling: SamplingParams
    val_sampling: SamplingParams
    reward_options: RewardOptions
    total_steps: int
    sync_weights: Callable[[], None]  # the rollout engine takes the policy's current weights
    profile: PolicyProfile  # the policy's shape, for MFU
    # The ranks that train (throughput and MFU are per GPU): 1 in one process, else the group's size.
    world_size: int = 1
    groups: Groups | None = None  # the Ray role groups, to shut down at the end
    agent: AgentLoop | None = None  # multi_turn.enable: rollouts that search while they generate
    tracker: Tracker | None = None
    last_saved_step: int = 0

    def role_groups(self) -> list:
        """The Ray role groups (policy, reference, critic) that exist; none in one process."""
        if self.groups is None:
            return []
        return [g for g in (self.groups.policy, self.groups.reference, self.groups.critic) if g is not None]

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step computes the policy's logprobs before its update.

        The policy update can skip them when exactly on-policy (old == current). The KL penalty in the
        reward cannot: it is taken against the policy that sampled, before the advantages exist. Nor can
        a separate engine (builtin, sglang): it samples from its own copy (bf16, its own kernels), so the
        trainer's logprobs are recomputed, and their gap to the engine's is logged every step.
        """
        batch_size = self.plan.prompts * self.sampling.n
        separate_engine = self.cfg.actor_rollout_ref.rollout.engine != "hf"
        return self.advantage.use_kl_in_reward or separate_engine or not self.policy.is_on_policy(batch_size)


async def build_run(cfg: Config) -> Run:
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    device = resolve_device(trainer.device)
    precision = default_precision(device, trainer.mixed_precision)
    tokenizer = load_tokenizer(
        cfg.data.tokenizer or arr.model.path, trust_remote_code=arr.model.trust_remote_code
    )
    multi_turn = arr.rollout.multi_turn
    tool = agent_tools(multi_turn, cfg.services) if multi_turn.enable else None
    data = cfg.data
    if tool is not None:  # the hermes format shows the tool's schema to the model in the prompt
        kwargs = {**data.apply_chat_template_kwargs, **chat_template_tools(multi_turn, tool)}
        data = data.model_copy(update={"apply_chat_template_kwargs": kwargs})
    source = await open_prompt_source(
        data, cfg.services, tokenizer, chat_template=arr.model.custom_chat_template
    )
    steps = total_steps(
        source.train_size, cfg.data.train_batch_size, trainer.total_epochs, trainer.total_training_steps
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
    workers = build_workers(cfg, device, precision, steps, tokenizer)
    agent = None
    if tool is not None:  # over the engine's async path (the rollout manager of builtin / sglang)
        agent = await build_agent(
            multi_turn,
            cfg.services,
            tool,
            engine=workers["engine"],
            tokenizer=tokenizer,
            max_response_length=cfg.data.max_response_length,
        )
    return Run(
        cfg=cfg,
        tokenizer=tokenizer,
        source=source,
        scorer=scorer,
        agent=agent,
        **workers,
        kl_ctrl=kl_controller(cfg.algorithm.kl_ctrl),
        advantage=advantage_settings(cfg.algorithm),
        plan=batch_plan(cfg),
        sampling=sampling_params(arr.rollout, cfg.data.max_response_length, validation=False),
        val_sampling=sampling_params(arr.rollout, cfg.data.max_response_length, validation=True),
        reward_options=reward_options(cfg.reward_model, cfg.data.max_response_length),
        total_steps=steps,
    )


async def close_run(run: Run) -> None:
    if run.agent is not None:
        await run.agent.aclose()
    run.engine.close()
    if run.tracker is not None:
        run.tracker.close()
    if run.groups is not None:
        run.groups.shutdown()
    await close_scorer(run.scorer)
    await run.source.aclose()


# ------------------------------------------------------------------------------------------ workers


def build_workers(cfg: Config, device: torch.device, precision: Precision, steps: int, tokenizer) -> dict:
    """The policy, reference, critic and rollout engine: Ray role groups (trainer/cluster.py) or, on one
    device by default, plain workers in this process with the engine next to the policy."""
    from trainer import cluster

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cluster.use_ray(cfg):
        groups = cluster.build_groups(cfg, device, precision, steps, pad_id)
        engine = groups.engine
        if engine is None:  # rollout servers: each sync sends them a checkpoint rank 0 writes
            engine = build_engine(cfg, None, tokenizer, precision)
            weights = GroupWeights(groups.policy)
            sync = functools.partial(engine.load_weights, weights)
        else:
            sync = engine.load_weights
        return {
            "policy": groups.policy,
            "reference": groups.reference,
            "critic": groups.critic,
            "engine": engine,
            "sync_weights": sync,
            "profile": groups.policy.profile(),
            "world_size": groups.policy.world_size,
            "groups": groups,
        }
    policy = build_policy(cfg, device, precision, steps)
    engine = build_engine(cfg, policy.model, tokenizer, precision)
    return {
        "policy": policy,
        "reference": build_reference(cfg, device, precision) if cfg.use_reference else None,
        "critic": build_critic(cfg, device, precision, steps) if cfg.use_critic else None,
        "engine": engine,
        # hf shares the policy's module (nothing to copy); builtin / sglang get the weights copied in
        "sync_weights": lambda: engine.load_weights(policy.model),
        "profile": PolicyProfile.of(policy.model, policy.update_settings.ppo_epochs, in_process=True),
    }


def build_engine(cfg: Config, policy_model, tokenizer, precision: Precision) -> RolloutEngine:
    """The one-process engine (rollout.engine), or the rollout servers' manager of a Ray run.

    The built-in engine shares the policy's GPU: its KV cache exists only while it generates
    (trainer/workers/engines.py), sized from rollout.gpu_memory_utilization. Multi-turn runs take it
    behind the rollout manager instead: the agent loop's many one-context turns need its async,
    continuously batching path.
    """
    rollout = cfg.actor_rollout_ref.rollout
    context_length = rollout.prompt_length + rollout.response_length
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if rollout.engine == "builtin" and not rollout.multi_turn.enable:
        device = next(policy_model.parameters()).device
        return builtin_engine(
            policy_model,
            tokenizer,
            device=device,
            context_length=context_length,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            pad_id=pad_id,
        )
    return build_rollout(
        rollout.engine,
        policy_model=policy_model,
        tokenizer=tokenizer,
        model_path=cfg.actor_rollout_ref.model.path,
        context_length=context_length,
        autocast_dtype=precision.autocast_dtype,
        server_urls=server_urls_from_env(),
        gpus=visible_gpus(),
        gpu_memory_utilization=rollout.gpu_memory_utilization,
    )


def build_policy(cfg: Config, device: torch.device, precision: Precision, steps: int) -> Policy:
    arr, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    actor = arr.actor
    model = load_policy(
        arr.model.path,
        device=device,
        param_dtype=precision.param_dtype,
        trust_remote_code=arr.model.trust_remote_code,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
    )
    if arr.model.use_remove_padding:
        use_packed_attention(model)
    # hf generates with the policy's own layers (a KV cache each step): those stay eager
    compiled = actor.use_torch_compile and device.type == "cuda" and arr.rollout.engine != "hf"
    if compiled:
        compile_model(model, device=device, dtype=None, autocast_dtype=precision.autocast_dtype)
    return Policy(
        model,
        optimizer_settings(actor.optim, actor.grad_clip, steps),
        UpdateSettings(
            mini_batch_size=actor.ppo_mini_batch_size * n,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            ppo_epochs=actor.ppo_epochs,
            token_budget=token_budget(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        ),
        policy_loss_settings(actor),
        temperature=arr.rollout.temperature or 1.0,
        log_prob_micro_batch_size=log_prob_micro_batch(arr.rollout),
        autocast_dtype=precision.autocast_dtype,
        head=LogprobHead(fused=arr.model.use_fused_kernels, compiled=compiled),
    )


def build_reference(cfg: Config, device: torch.device, precision: Precision) -> Reference:
    arr = cfg.actor_rollout_ref
    model = load_reference(
        arr.model.path,
        device=device,
        param_dtype=precision.param_dtype,
        trust_remote_code=arr.model.trust_remote_code,
    )
    if arr.model.use_remove_padding:
        use_packed_attention(model)
    compiled = arr.ref.use_torch_compile and device.type == "cuda"
    if compiled:
        compile_model(model, device=device, dtype=None, autocast_dtype=precision.autocast_dtype, train=False)
    return Reference(
        model,
        micro_batch_size=log_prob_micro_batch(arr.ref),
        temperature=arr.rollout.temperature or 1.0,
        autocast_dtype=precision.autocast_dtype,
        head=LogprobHead(fused=arr.model.use_fused_kernels, compiled=compiled),
    )


def build_critic(cfg: Config, device: torch.device, precision: Precision, steps: int) -> Critic:
    critic = cfg.critic
    model = load_critic(
        critic.model.path,
        device=device,
        param_dtype=precision.param_dtype,
        trust_remote_code=bool(critic.model.trust_remote_code),
        gradient_checkpointing=critic.model.enable_gradient_checkpointing,
    )
    if critic.model.use_remove_padding:
        use_packed_attention(model)
    return Critic(
        model,
        optimizer_settings(critic.optim, critic.grad_clip, steps),
        UpdateSettings(
            mini_batch_size=critic.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n,
            micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
            ppo_epochs=critic.ppo_epochs,
            token_budget=token_budget(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
        ),
        ValueLossSettings(
            cliprange_value=critic.cliprange_value,
            loss_agg_mode=critic.loss_agg_mode,
            max_response_len=cfg.data.max_response_length,
        ),
        forward_micro_batch_size=value_micro_batch(critic),
        autocast_dtype=precision.autocast_dtype,
    )


# ------------------------------------------------------------------------------------------ settings


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


def token_budget(use_dynamic_bsz: bool, max_tokens: int) -> TokenBudget | None:
    """verl's use_dynamic_bsz: micro-batches by tokens, not sequences (trainer/workers/common.py)."""
    return TokenBudget(max_tokens) if use_dynamic_bsz else None


def log_prob_micro_batch(section) -> MicroBatchSize:
    """A log-prob pass's micro-batches (the rollout's old logprobs, the reference's)."""
    budget = token_budget(section.log_prob_use_dynamic_bsz, section.log_prob_max_token_len_per_gpu)
    return budget or section.log_prob_micro_batch_size_per_gpu


def value_micro_batch(critic) -> MicroBatchSize:
    """The critic's value forwards (compute_values), as log_prob_micro_batch for the log-prob passes."""
    budget = token_budget(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu)
    return budget or critic.forward_micro_batch_size_per_gpu


def policy_loss_settings(actor) -> PolicyLossSettings:
    """actor.loss_scale_factor is the Dr.GRPO divisor; the config derives it from data.max_response_length."""
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


def advantage_settings(algorithm) -> AdvantageSettings:
    return AdvantageSettings(
        estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_by_std=algorithm.norm_adv_by_std_in_grpo,
        use_kl_in_reward=algorithm.use_kl_in_reward,
        kl_penalty=algorithm.kl_penalty,
    )


def batch_plan(cfg: Config) -> BatchPlan:
    groups = cfg.algorithm.filter_groups
    if not groups.enable:
        return BatchPlan(
            prompts=cfg.data.train_batch_size, prompts_per_round=cfg.data.train_batch_size, group_filter=None
        )
    return BatchPlan(
        prompts=cfg.data.train_batch_size,
        prompts_per_round=cfg.data.gen_batch_size,
        group_filter=GroupFilter(metric=groups.metric, max_rounds=groups.max_num_gen_batches),
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


def kl_controller(kl_ctrl) -> KLController:
    if kl_ctrl.type == "adaptive":
        return algos.AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    return algos.FixedKLController(kl_ctrl.kl_coef)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
