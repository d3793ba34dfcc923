"""Everything a run builds once, from the config: the parts the fit loop drives, each with its settings.

`build_run(cfg)` opens the prompt source and the scorer, starts every role's ranks (one in this process,
or Ray actors: trainer/parallel/groups.py, with the settings of trainer/parallel/settings.py), and puts
the rollout manager over the policy ranks' engines (or SGLang servers), with the agent loop on top for
multi-turn runs. The step then passes data only (`run.policy.update(batch)`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from services.reward_server.schemas import RewardOptions
from trainer import algos
from trainer.agent.build import agent_tools, build_agent, chat_template_tools
from trainer.agent.loop import AgentLoop
from trainer.algos import KLKind
from trainer.config import Config
from trainer.config.derive import needs_old_logprobs, pad_token_id, tokenizer_source
from trainer.data import PromptSource, open_prompt_source, total_steps
from trainer.model import default_precision, load_tokenizer
from trainer.parallel.groups import (
    CriticGroup,
    Groups,
    GroupWeights,
    PolicyGroup,
    ReferenceGroup,
    build_groups,
)
from trainer.parallel.ranks import PolicyProfile
from trainer.rewards import Scorer, close_scorer, open_scorer, reward_options
from trainer.rollout.base import SamplingParams
from trainer.rollout.manager import (
    RolloutManager,
    build_rollout,
    server_urls_from_env,
    visible_gpus,
    weights_dir_from_env,
)
from trainer.tracking import Tracker

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
    drop_failed_tool_groups: bool = False  # multi_turn.tool_failure=drop_group: leave out failed groups


@dataclass
class Run:
    """Everything a run builds once; the loop reads its parts and passes them data."""

    cfg: Config  # trainer.* (frequencies, folders, logger) for the driver itself
    tokenizer: PreTrainedTokenizerBase
    pad_id: int  # what batches pad with
    source: PromptSource
    scorer: Scorer
    groups: Groups  # the role groups: one rank in this process, or Ray ranks
    rollout: RolloutManager  # every rollout: the policy ranks' engines, or SGLang servers
    kl_ctrl: KLController
    advantage: AdvantageSettings
    plan: BatchPlan
    sampling: SamplingParams
    val_sampling: SamplingParams
    reward_options: RewardOptions
    total_steps: int
    profile: PolicyProfile  # the policy's shape, for MFU
    needs_old_logprobs: bool  # trainer/config/derive.py: not exactly on-policy, or a KL penalty in the reward
    agent: AgentLoop | None = None  # multi_turn.enable: rollouts that call tools while they generate
    tracker: Tracker | None = None
    last_saved_step: int = 0

    @property
    def policy(self) -> PolicyGroup:
        return self.groups.policy

    @property
    def reference(self) -> ReferenceGroup | None:
        return self.groups.reference

    @property
    def critic(self) -> CriticGroup | None:
        return self.groups.critic

    @property
    def world_size(self) -> int:
        """The ranks that train (throughput and MFU are per GPU)."""
        return self.groups.policy.world_size

    @property
    def colocated(self) -> bool:
        """The policy ranks' own engines generate (hf, builtin), not rollout servers."""
        return self.cfg.actor_rollout_ref.rollout.engine != "sglang"

    async def sync_weights(self) -> None:
        """The engines take the policy's current weights: inside the ranks (colocated), else a
        checkpoint rank 0 writes for the servers."""
        if self.colocated:
            self.policy.sync_weights()
        else:
            await self.rollout.load_weights_async(GroupWeights(self.policy))


async def build_run(cfg: Config) -> Run:
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    device = resolve_device(trainer.device)
    tokenizer_from = tokenizer_source(cfg)  # the policy ranks load the same one (parallel/settings.py)
    tokenizer = load_tokenizer(tokenizer_from.path, trust_remote_code=tokenizer_from.trust_remote_code)
    multi_turn = arr.rollout.multi_turn
    tools = agent_tools(multi_turn, cfg.services) if multi_turn.enable else None
    data = cfg.data
    if tools is not None:  # the hermes format shows the tools' schemas to the model in the prompt
        kwargs = {**data.apply_chat_template_kwargs, **chat_template_tools(multi_turn, tools)}
        data = data.model_copy(update={"apply_chat_template_kwargs": kwargs})
    source = await open_prompt_source(
        data, cfg.services, tokenizer, chat_template=arr.model.custom_chat_template, validation=cfg.validates
    )
    steps = total_steps(
        source.train_size, cfg.data.train_batch_size, trainer.total_epochs, trainer.total_training_steps
    )
    scorer = await open_scorer(cfg.reward_model, cfg.services, cfg.custom_reward_function)
    groups = build_groups(cfg, device, default_precision(device, trainer.mixed_precision), steps)
    pad_id = pad_token_id(tokenizer)
    rollout = build_rollout(
        arr.rollout.engine,
        replicas=groups.policy.replicas() if arr.rollout.engine != "sglang" else (),
        model_path=arr.model.path,
        server_urls=server_urls_from_env(),
        gpus=visible_gpus(),
        tp_size=arr.rollout.tensor_model_parallel_size,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        weights_dir=weights_dir_from_env(),
        token=cfg.services.auth_token,
        trust_remote_code=tokenizer_from.trust_remote_code,  # SGLang's one switch: model and tokenizer
        tokenizer_path=cfg.data.tokenizer,
        loop=asyncio.get_running_loop(),
    )
    agent = None
    if tools is not None:
        agent = await build_agent(
            multi_turn,
            cfg.services,
            tools,
            engine=rollout,
            tokenizer=tokenizer,
            max_response_length=arr.rollout.response_length,
            chat_template=arr.model.custom_chat_template,
            template_kwargs=data.apply_chat_template_kwargs,
        )
    return Run(
        cfg=cfg,
        tokenizer=tokenizer,
        pad_id=pad_id,
        source=source,
        scorer=scorer,
        groups=groups,
        rollout=rollout,
        agent=agent,
        kl_ctrl=kl_controller(cfg.algorithm.kl_ctrl),
        advantage=advantage_settings(cfg.algorithm),
        plan=batch_plan(cfg),
        # rollout.response_length bounds generation, as in verl (data.max_response_length unless set)
        sampling=sampling_params(arr.rollout, arr.rollout.response_length, validation=False),
        val_sampling=sampling_params(arr.rollout, arr.rollout.response_length, validation=True),
        reward_options=reward_options(cfg.reward_model, cfg.data.max_response_length),
        total_steps=steps,
        profile=groups.policy.profile(),
        needs_old_logprobs=needs_old_logprobs(cfg),
    )


async def close_run(run: Run) -> None:
    if run.agent is not None:
        await run.agent.aclose()
    await run.rollout.close_async()
    if run.tracker is not None:
        run.tracker.close()
    run.groups.shutdown()
    await close_scorer(run.scorer)
    await run.source.aclose()


# ------------------------------------------------------------------------------------------ settings


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
    groups, multi_turn = cfg.algorithm.filter_groups, cfg.actor_rollout_ref.rollout.multi_turn
    return BatchPlan(
        prompts=cfg.data.train_batch_size,
        prompts_per_round=cfg.data.gen_batch_size if groups.enable else cfg.data.train_batch_size,
        group_filter=(
            GroupFilter(metric=groups.metric, max_rounds=groups.max_num_gen_batches)
            if groups.enable
            else None
        ),
        drop_failed_tool_groups=multi_turn.enable and multi_turn.tool_failure == "drop_group",
    )


def sampling_params(rollout, max_response_length: int, *, validation: bool) -> SamplingParams:
    # validation samples with val_kwargs (greedy unless do_sample); the stop strings and ids are shared
    kw = rollout.val_kwargs if validation else rollout
    return SamplingParams(
        temperature=kw.temperature if kw.do_sample else 0.0,
        top_p=kw.top_p,
        top_k=kw.top_k or -1,  # the schema's 0 is off, as in vLLM
        max_new_tokens=max_response_length,
        stop=tuple(rollout.stop),
        stop_token_ids=tuple(rollout.stop_token_ids),
        n=kw.n,
    )


def kl_controller(kl_ctrl) -> KLController:
    if kl_ctrl.type == "adaptive":
        return algos.AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    return algos.FixedKLController(kl_ctrl.kl_coef)


def resolve_device(name: str) -> torch.device:
    """The run's device, with its index: a bare "cuda" means this process's current GPU (the one Ray or
    CUDA_VISIBLE_DEVICES gave it), since torch.cuda.set_device refuses a CUDA device without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
