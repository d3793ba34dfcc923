"""The run's workers as Ray role groups: one rank per GPU across trainer.nnodes x trainer.n_gpus_per_node.

`build_groups` is the distributed twin of trainer/run.py's build_policy / build_reference /
build_critic: the same config keys become the same settings, handed to every rank of a role group
(trainer/workers/group.py) instead of to one in-process worker. The policy ranks also run the
rollout engine (colocated, as verl's hybrid engine: the built-in fast engine unless rollout.name=hf),
so generation spreads over every GPU and the weights reach the engines without leaving the GPUs. With
rollout.name=sglang the ranks run no engine: SGLang servers generate over HTTP (trainer/run.py builds
their manager) and load each new policy from a checkpoint folder that rank 0 writes.

When Ray is used (`use_ray`): `trainer.use_ray=true`, or by default whenever the run asks for more
than one GPU. One process without Ray stays the default for a single device: CPU debugging, the
offline demo, a one-GPU run.

Placement: all roles share one pool of bundles (one per GPU) by default, each role's rank r taking
a fraction of bundle r; `trainer.role_pools=separate` gives every role its own GPUs instead.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from trainer.config import Config
from trainer.fsdp import FSDPSettings
from trainer.model import Precision
from trainer.workers.common import UpdateSettings
from trainer.workers.critic import ValueLossSettings
from trainer.workers.logprobs import LogprobHead
from trainer.workers.group import (
    CriticGroup,
    GroupRolloutEngine,
    PolicyGroup,
    ReferenceGroup,
    ResourcePool,
    connect_ray,
)
from trainer.workers.ranks import (
    CriticRankSettings,
    EngineSettings,
    ModelSettings,
    PolicyRankSettings,
    ReferenceRankSettings,
    build_critic,
    build_policy,
    build_reference,
)

log = logging.getLogger("trainer")


def use_ray(cfg: Config) -> bool:
    """Ray role groups, or the workers in this process."""
    return cfg.uses_ray


@dataclass
class Groups:
    policy: PolicyGroup
    reference: ReferenceGroup | None
    critic: CriticGroup | None
    engine: GroupRolloutEngine | None  # None: generation runs on rollout servers (rollout.name=sglang)
    pools: list[ResourcePool]

    def shutdown(self) -> None:
        for group in (self.policy, self.reference, self.critic):
            if group is not None:
                group.shutdown()
        for pool in self.pools:
            pool.release()


def build_groups(cfg: Config, device: torch.device, precision: Precision, steps: int, pad_id: int) -> Groups:
    """Start (or join) Ray, reserve the GPUs and start every role's ranks, each loading its model."""
    trainer = cfg.trainer
    how = connect_ray(num_cpus=max(cfg.world_size, os.cpu_count() or 1) if device.type == "cpu" else None)
    roles = 1 + int(cfg.use_reference) + int(cfg.use_critic)
    separate = trainer.role_pools == "separate"
    pools = [
        ResourcePool(trainer.nnodes, trainer.n_gpus_per_node, use_gpu=device.type == "cuda")
        for _ in range(roles if separate else 1)
    ]
    pool_of = iter(pools * (1 if separate else roles))
    common = {
        "share": 1.0 if separate else 1.0 / roles,
        "seed": trainer.seed,
        "balance": trainer.balance_batch,
    }
    settings = policy_rank_settings(cfg, precision, steps)
    policy = PolicyGroup(
        next(pool_of),
        functools.partial(build_policy, settings),
        mini_batch_size=settings.update.mini_batch_size,
        ppo_epochs=settings.update.ppo_epochs,
        **common,
    )
    reference = critic = None
    if cfg.use_reference:
        build = functools.partial(build_reference, reference_rank_settings(cfg, precision))
        reference = ReferenceGroup(next(pool_of), build, **common)
    if cfg.use_critic:
        critic_settings = critic_rank_settings(cfg, precision, steps)
        build = functools.partial(build_critic, critic_settings)
        mini_batch_size = critic_settings.update.mini_batch_size
        critic = CriticGroup(next(pool_of), build, mini_batch_size=mini_batch_size, **common)
    log.info(
        "%s; %d rank(s) per role on %d node(s), roles %s",
        how,
        policy.world_size,
        len(set(policy.node_ids())),
        "on separate GPUs" if separate else "colocated",
    )
    engine = GroupRolloutEngine(policy, pad_id) if settings.engine is not None else None
    return Groups(policy, reference, critic, engine, pools)


# ------------------------------------------------------------------------------ config -> rank settings
# The same config keys the single process reads (trainer/run.py), turned into settings for every rank.


def policy_rank_settings(cfg: Config, precision: Precision, steps: int) -> PolicyRankSettings:
    from trainer.run import log_prob_micro_batch, optimizer_settings, policy_loss_settings, token_budget

    arr = cfg.actor_rollout_ref
    return PolicyRankSettings(
        model=model_settings(
            arr.model, arr.actor.fsdp_config, precision, compile=arr.actor.use_torch_compile
        ),
        optim=optimizer_settings(arr.actor.optim, arr.actor.grad_clip, steps),
        update=UpdateSettings(
            mini_batch_size=whole_ranks(arr.actor.ppo_mini_batch_size * arr.rollout.n, cfg.world_size),
            micro_batch_size=arr.actor.ppo_micro_batch_size_per_gpu,
            ppo_epochs=arr.actor.ppo_epochs,
            token_budget=token_budget(arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu),
        ),
        loss=policy_loss_settings(arr.actor),
        temperature=arr.rollout.temperature or 1.0,
        log_prob_micro_batch_size=log_prob_micro_batch(arr.rollout),
        head=logprob_head(arr.model, arr.actor.use_torch_compile),
        engine=engine_settings(arr.rollout),
    )


def engine_settings(rollout) -> EngineSettings | None:
    """The policy ranks' colocated engine; None when rollout servers generate instead."""
    if rollout.engine == "sglang":
        return None
    return EngineSettings(
        name=rollout.engine,
        context_length=rollout.prompt_length + rollout.response_length,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
    )


def reference_rank_settings(cfg: Config, precision: Precision) -> ReferenceRankSettings:
    from trainer.run import log_prob_micro_batch

    arr = cfg.actor_rollout_ref
    return ReferenceRankSettings(
        model=model_settings(
            arr.model, arr.ref.fsdp_config, precision, trainable=False, compile=arr.ref.use_torch_compile
        ),
        temperature=arr.rollout.temperature or 1.0,
        micro_batch_size=log_prob_micro_batch(arr.ref),
        head=logprob_head(arr.model, arr.ref.use_torch_compile),
    )


def critic_rank_settings(cfg: Config, precision: Precision, steps: int) -> CriticRankSettings:
    from trainer.run import optimizer_settings, token_budget, value_micro_batch

    critic = cfg.critic
    return CriticRankSettings(
        model=model_settings(critic.model, critic.model.fsdp_config, precision),
        optim=optimizer_settings(critic.optim, critic.grad_clip, steps),
        update=UpdateSettings(
            mini_batch_size=whole_ranks(
                critic.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n, cfg.world_size
            ),
            micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
            ppo_epochs=critic.ppo_epochs,
            token_budget=token_budget(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
        ),
        loss=ValueLossSettings(
            cliprange_value=critic.cliprange_value,
            loss_agg_mode=critic.loss_agg_mode,
            max_response_len=cfg.data.max_response_length,
        ),
        forward_micro_batch_size=value_micro_batch(critic),
    )


def whole_ranks(sequences: int, world_size: int) -> int:
    """A mini-batch as verl sizes it on `world_size` GPUs: each takes the floor of its share."""
    return sequences // world_size * world_size


def model_settings(
    model, fsdp, precision: Precision, *, trainable: bool = True, compile: bool = False
) -> ModelSettings:
    """actor_rollout_ref.model / critic.model and their fsdp_config, for every rank (compile: on CUDA)."""
    # bf16 gathers: bf16 parameters, fp32 gathers: the single process's fp32 parameters; both computed
    # under the single process's bf16 autocast (norms, softmax and the rotary embedding in fp32). Without
    # autocast, bf16 ranks ran the compiled rotary embedding ~10x slower (0.5 ms a layer on an H100:
    # bench/actor_mfu.py, fsdp-compiled against fsdp-autocast-compiled)
    fp32_gathers = fsdp.mixed_precision.fp32_gathers
    return ModelSettings(
        path=model.path,
        trust_remote_code=bool(model.trust_remote_code),
        gradient_checkpointing=trainable and bool(model.enable_gradient_checkpointing),
        remove_padding=bool(model.use_remove_padding),
        compile=compile,
        autocast_dtype=precision.autocast_dtype,
        fsdp=FSDPSettings(
            param_dtype=None if fp32_gathers else precision.autocast_dtype,
            reshard_after_forward=bool(fsdp.reshard_after_forward),
            offload_policy=bool(fsdp.offload_policy),
            param_offload=bool(fsdp.param_offload),
            optimizer_offload=trainable and bool(fsdp.optimizer_offload),
        ),
    )


def logprob_head(model, use_torch_compile: bool) -> LogprobHead:
    """model.use_fused_kernels; its chunk math compiled with the layers (on CUDA only)."""
    return LogprobHead(fused=bool(model.use_fused_kernels), compiled=bool(use_torch_compile))
