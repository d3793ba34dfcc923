"""Config -> rank settings: the one place where the config's keys become what every rank of a role is
built with (trainer/parallel/ranks.py), for a group of one rank in this process and for Ray ranks alike.

verl's batch sizes count prompts; every size handed to a rank counts sequences (prompts x rollout.n),
and the update's mini-batch is the GLOBAL one (the group splits each over its ranks).
"""

from __future__ import annotations

from trainer.config import Config
from trainer.config.derive import (
    TokenizerSource,
    log_prob_micro_batch,
    logprob_temperature,
    mini_batch_sequences,
    token_budget,
    tokenizer_source,
    value_micro_batch,
)
from trainer.model import Precision
from trainer.parallel.fsdp import FSDPSettings
from trainer.parallel.ranks import (
    CriticRankSettings,
    EngineSettings,
    ModelSettings,
    PolicyRankSettings,
    ReferenceRankSettings,
)
from trainer.workers.common import OptimizerSettings, UpdateSettings
from trainer.workers.critic import ValueLossSettings
from trainer.workers.logprobs import LogprobHead
from trainer.workers.policy import PolicyLossSettings


def policy_rank_settings(cfg: Config, precision: Precision, steps: int) -> PolicyRankSettings:
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    return PolicyRankSettings(
        model=model_settings(
            arr.model,
            actor.fsdp_config,
            precision,
            compile=actor.use_torch_compile,
            tokenizer=tokenizer_source(cfg),
        ),
        optim=optimizer_settings(actor.optim, actor.grad_clip, steps),
        update=UpdateSettings(
            mini_batch_size=mini_batch_sequences(actor.ppo_mini_batch_size, arr.rollout.n, cfg.world_size),
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            ppo_epochs=actor.ppo_epochs,
            token_budget=token_budget(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        ),
        loss=policy_loss_settings(actor),
        temperature=logprob_temperature(arr.rollout),
        log_prob_micro_batch_size=log_prob_micro_batch(arr.rollout),
        head=logprob_head(arr.model, actor.use_torch_compile),
        engine=engine_settings(arr.rollout),
    )


def engine_settings(rollout) -> EngineSettings | None:
    """The policy ranks' colocated engine; None when rollout servers (SGLang) generate instead."""
    if rollout.engine == "sglang":
        return None
    return EngineSettings(
        name=rollout.engine,
        context_length=rollout.prompt_length + rollout.response_length,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        hf_if_refused=rollout.name in ("auto", "vllm"),
    )


def reference_rank_settings(cfg: Config, precision: Precision) -> ReferenceRankSettings:
    arr = cfg.actor_rollout_ref
    return ReferenceRankSettings(
        model=model_settings(
            arr.model, arr.ref.fsdp_config, precision, trainable=False, compile=arr.ref.use_torch_compile
        ),
        temperature=logprob_temperature(arr.rollout),
        micro_batch_size=log_prob_micro_batch(arr.ref),
        head=logprob_head(arr.model, arr.ref.use_torch_compile),
    )


def critic_rank_settings(cfg: Config, precision: Precision, steps: int) -> CriticRankSettings:
    critic, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
    return CriticRankSettings(
        # the critic reads the driver's token ids: its checkpoint saves the driver's tokenizer
        model=model_settings(
            critic.model, critic.model.fsdp_config, precision, tokenizer=tokenizer_source(cfg)
        ),
        optim=optimizer_settings(critic.optim, critic.grad_clip, steps),
        update=UpdateSettings(
            mini_batch_size=mini_batch_sequences(critic.ppo_mini_batch_size, n, cfg.world_size),
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


def model_settings(
    model,
    fsdp,
    precision: Precision,
    *,
    trainable: bool = True,
    compile: bool = False,
    tokenizer: TokenizerSource | None = None,
) -> ModelSettings:
    """actor_rollout_ref.model / critic.model and their fsdp_config (compile: on CUDA only);
    `tokenizer`: the run's (tokenizer_source), for a role that generates or saves one.

    Numerics, the same at every scale (one rank in this process or many in Ray): fp32 master weights
    sharded by FSDP2, gathered in bf16 (fp32 with mixed_precision.param_dtype=fp32) and computed under
    bf16 autocast on GPUs (norms, softmax and the rotary embedding in fp32); fp32 throughout on the CPU.
    Without autocast, bf16 ranks ran the compiled rotary embedding ~10x slower (0.5 ms a layer on an
    H100: bench/actor_mfu.py, fsdp-compiled against fsdp-autocast-compiled).
    """
    fp32_gathers = fsdp.mixed_precision.fp32_gathers
    return ModelSettings(
        path=model.path,
        trust_remote_code=bool(model.trust_remote_code),
        gradient_checkpointing=trainable and bool(model.enable_gradient_checkpointing),
        remove_padding=bool(model.use_remove_padding),
        share_prompts=bool(model.share_prompts),
        compile=compile,
        autocast_dtype=precision.autocast_dtype,
        tokenizer=tokenizer,
        fsdp=FSDPSettings(
            param_dtype=None if fp32_gathers else precision.autocast_dtype,
            reshard_after_forward=bool(fsdp.reshard_after_forward),
            layers_per_unit=fsdp.layers_per_unit,
            offload_policy=bool(fsdp.offload_policy),
            param_offload=bool(fsdp.param_offload),
            optimizer_offload=trainable and bool(fsdp.optimizer_offload),
        ),
    )


def logprob_head(model, use_torch_compile: bool) -> LogprobHead:
    """model.use_fused_kernels; its chunk math compiled with the layers (on CUDA only)."""
    return LogprobHead(fused=bool(model.use_fused_kernels), compiled=bool(use_torch_compile))


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
        skip_zero_advantage_rows=actor.skip_zero_advantage_rows,
    )
