"""Derived values: every `null: <rule>` default becomes a concrete value, so the printed config is what runs.

verl derives the same values in its workers (mini-batches times rollout.n, deprecated global micro-batches
divided by the GPU count, the critic inheriting the actor's sizes); here they are derived once, when the
config is built, and every consumer reads the result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel

from trainer.config.run import Config
from trainer.config.schema import Section


def fast_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), read without torch. Without it
    torch's bf16 matmul takes a generic path: ~70x slower than fp32 on an AVX2 AMD EPYC (BENCHMARKS.md)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_present() -> bool:
    """An NVIDIA GPU this process may use, seen without importing torch (the config stays torch-free)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return not hidden and os.path.exists("/dev/nvidiactl")


def slow_bf16(config: Config) -> bool:
    """trainer.mixed_precision=bf16 asked for on a CPU without bf16 hardware: the run uses fp32 instead."""
    device = config.trainer.device
    on_cpu = device == "cpu" or (device == "auto" and not gpu_present())
    return config.trainer.mixed_precision == "bf16" and on_cpu and not fast_bf16_cpu()


def per_gpu(global_size: int | None, world: int) -> int | None:
    """A global batch size split over the GPUs, rounded down as verl's workers do (None stays None)."""
    return None if global_size is None else global_size // world


# ------------------------------------------------------------------------------ values the workers take
# Derived from the config (and the tokenizer) in one place: the rank settings (trainer/parallel/
# settings.py), the loop and the engines read these, never the raw keys.


@dataclass(frozen=True)
class TokenBudget:
    """verl's use_dynamic_bsz: micro-batches of whole, consecutive sequences of at most `max_tokens`
    tokens (prompt + response) each; a longer sequence goes alone. A count of sequences launches as
    many kernels for short sequences as for long ones; a token budget keeps every forward equally full.
    """

    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


MicroBatchSize = int | TokenBudget  # sequences per forward, or a token budget


def token_budget(use_dynamic_bsz: bool, max_tokens: int) -> TokenBudget | None:
    """verl's use_dynamic_bsz: micro-batches by tokens, not sequences."""
    return TokenBudget(max_tokens) if use_dynamic_bsz else None


def log_prob_micro_batch(section: Any) -> MicroBatchSize:
    """A log-prob pass's micro-batches (the rollout's old logprobs, the reference's)."""
    budget = token_budget(section.log_prob_use_dynamic_bsz, section.log_prob_max_token_len_per_gpu)
    return budget or section.log_prob_micro_batch_size_per_gpu


def value_micro_batch(critic: Any) -> MicroBatchSize:
    """The critic's value forwards (compute_values), as log_prob_micro_batch for the log-prob passes."""
    budget = token_budget(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu)
    return budget or critic.forward_micro_batch_size_per_gpu


def mini_batch_sequences(prompts: int, n: int, world: int) -> int:
    """A mini-batch in sequences as verl sizes it on `world` GPUs: each rank takes the floor of its share."""
    return prompts * n // world * world


def logprob_temperature(rollout: Any) -> float:
    """The temperature logprobs are taken under: the rollout's; greedy (0) means the untempered model."""
    return rollout.temperature or 1.0


@dataclass(frozen=True)
class TokenizerSource:
    """Where the run's one tokenizer is loaded from (trainer.model.load_tokenizer's arguments)."""

    path: str
    trust_remote_code: bool = False


def tokenizer_source(config: Config) -> TokenizerSource:
    """data.tokenizer (a tokenizer other than the model's), else the policy model's. The driver's
    prompts, the policy ranks' engines (eos ids, stop strings) and the tokenizer a checkpoint saves
    must all be this one: a rank reading the model folder's instead stopped on other eos ids."""
    data, model = config.data, config.actor_rollout_ref.model
    return TokenizerSource(
        path=data.tokenizer or model.path,
        trust_remote_code=bool(data.trust_remote_code or model.trust_remote_code),
    )


def pad_token_id(tokenizer: Any) -> int:
    """What batches pad with: the tokenizer's pad token, else its eos token (as verl)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def is_on_policy(batch_size: int, mini_batch_size: int, ppo_epochs: int) -> bool:
    """True when an update takes exactly one optimizer step on the whole batch: the policy that sampled is
    the one being updated, so old logprobs equal the update's own (detached) and need no forward."""
    return ppo_epochs == 1 and mini_batch_size >= batch_size


def needs_old_logprobs(config: Config) -> bool:
    """Whether a step computes the policy's logprobs before its update: when not exactly on-policy, or
    for the KL penalty in the reward (taken against the policy that sampled, before the advantages exist).

    Whichever engine sampled: on-policy, the update's own forward gives the same logprobs (the ratio is
    1 and the gradient the policy gradient), and it measures the engine's gap to them as well
    (trainer/workers/policy.py `engine_gap_terms`). The pass took 1.3-1.9 s of 7-15 s steps (H100, H200).
    """
    arr = config.actor_rollout_ref
    n, world = arr.rollout.n, config.world_size
    mini_batch = mini_batch_sequences(arr.actor.ppo_mini_batch_size, n, world)
    on_policy = is_on_policy(config.data.train_batch_size * n, mini_batch, arr.actor.ppo_epochs)
    return config.algorithm.use_kl_in_reward or not on_policy


def fill_derived(config: Config) -> None:
    """Fill every derived value in place, once, after validation (trainer/config/cli.py `load_config`)."""
    data, arr, critic = config.data, config.actor_rollout_ref, config.critic
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    world, n = config.world_size, rollout.n
    if data.source is None:
        data.source = "files" if data.train_files else "server"
    data.seed = config.trainer.seed if data.seed is None else data.seed
    data.gen_batch_size = data.gen_batch_size or data.train_batch_size
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    # what generates (trainer/rollout/manager.py `build_rollout`): auto and vllm (not wired in yet: checks.py
    # says so at start) pick the built-in engine on every device, so one engine generates at every scale
    rollout.engine = rollout.name if rollout.name in ("hf", "builtin", "sglang") else "builtin"
    if rollout.multi_turn.enable and rollout.engine == "hf":
        # the agent loop's turns reach the engine one by one, as their tool calls return: the built-in
        # engine batches them continuously, where hf runs one generate call per handful arriving together
        rollout.engine = "builtin"
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    actor.loss_scale_factor = actor.loss_scale_factor or data.max_response_length
    for optim in (actor.optim, critic.optim):
        optim.lr_scheduler_type = optim.warmup_style or optim.lr_scheduler_type
        optim.min_lr_ratio = optim.min_lr_ratio or 0.0
    _adopt_global(actor, "ppo_micro_batch_size", world, per_gpu(actor.ppo_mini_batch_size * n, world))
    for section in (rollout, ref):
        _adopt_global(section, "log_prob_micro_batch_size", world, actor.ppo_micro_batch_size_per_gpu)
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        section.log_prob_max_token_len_per_gpu = (
            section.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu
        )
    _fill_critic(config)
    for checkpoint in (actor.checkpoint, critic.checkpoint):
        if checkpoint.load_contents is None:
            checkpoint.load_contents = list(checkpoint.save_contents)
    if config.reward_model.mode == "auto":
        # verl scores in-process; a reward-server is used when one is configured (the job group does).
        config.reward_model.mode = "server" if config.services.reward_url else "local"
    _expand_home(config)
    resolve_references(config)


def _adopt_global(section: Section, old: str, world: int, fallback: int | None) -> None:
    """Set `<old>_per_gpu` from verl's deprecated global `<old>` (which is then cleared), else `fallback`.

    A global size smaller than the GPU count stays put for trainer/config/checks.py to report.
    """
    new = f"{old}_per_gpu"
    if getattr(section, new) is not None:
        return
    divided = per_gpu(getattr(section, old), world)
    if divided:
        setattr(section, old, None)
    setattr(section, new, divided or fallback)


def _fill_critic(config: Config) -> None:
    critic, arr = config.critic, config.actor_rollout_ref
    actor, world, n = arr.actor, config.world_size, arr.rollout.n
    if critic.enable is None:
        critic.enable = config.algorithm.adv_estimator == "gae"
    critic.model.path = critic.model.path or arr.model.path
    if critic.model.trust_remote_code is None:
        critic.model.trust_remote_code = arr.model.trust_remote_code
    if critic.model.use_remove_padding is None:
        critic.model.use_remove_padding = arr.model.use_remove_padding
    if critic.model.share_prompts is None:
        critic.model.share_prompts = arr.model.share_prompts
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    critic.loss_agg_mode = critic.loss_agg_mode or actor.loss_agg_mode
    critic.use_dynamic_bsz = (
        actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
    )
    critic.forward_max_token_len_per_gpu = (
        critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu
    )
    _adopt_global(critic, "ppo_micro_batch_size", world, per_gpu(critic.ppo_mini_batch_size * n, world))
    _adopt_global(critic, "forward_micro_batch_size", world, critic.ppo_micro_batch_size_per_gpu)


def _expand_home(config: Config) -> None:
    """`~/...` paths become absolute once, so no consumer has to remember expanduser."""

    def expand(path: str | None) -> str | None:
        return os.path.expanduser(path) if path and path.startswith("~") else path

    data, arr, trainer = config.data, config.actor_rollout_ref, config.trainer
    data.train_files = [expand(f) for f in data.train_files] if data.train_files else data.train_files
    data.val_files = [expand(f) for f in data.val_files] if data.val_files else data.val_files
    data.tokenizer = expand(data.tokenizer)
    arr.model.path = expand(arr.model.path)
    arr.rollout.multi_turn.tool_config_path = expand(arr.rollout.multi_turn.tool_config_path)
    config.critic.model.path = expand(config.critic.model.path)
    config.custom_reward_function.path = expand(config.custom_reward_function.path)
    trainer.resume_from_path = expand(trainer.resume_from_path)
    trainer.default_local_dir = expand(trainer.default_local_dir)
    trainer.log_dir = expand(trainer.log_dir)


def deprecated_conflicts(config: Config) -> list[str]:
    """verl refuses a deprecated global micro-batch given together with its per-GPU replacement."""
    arr = config.actor_rollout_ref
    pairs = [
        ("actor_rollout_ref.actor", arr.actor, "ppo_micro_batch_size"),
        ("actor_rollout_ref.rollout", arr.rollout, "log_prob_micro_batch_size"),
        ("actor_rollout_ref.ref", arr.ref, "log_prob_micro_batch_size"),
        ("critic", config.critic, "ppo_micro_batch_size"),
        ("critic", config.critic, "forward_micro_batch_size"),
    ]
    return [
        f"set only one of {prefix}.{old} (deprecated, global) and {prefix}.{old}_per_gpu"
        for prefix, section, old in pairs
        if getattr(section, old) is not None and getattr(section, f"{old}_per_gpu") is not None
    ]


def resolve_references(config: Config) -> None:
    """Resolve `${...}` left in text values (the checkpoint folder's default) with OmegaConf.

    load_config resolves the user's references before validation; the defaults' own are resolved here.
    """
    holders = list(_text_with_references(config, ""))
    if not holders:
        return
    tree = OmegaConf.create(config.model_dump(mode="json"))
    for section, name, key in holders:
        try:
            setattr(section, name, str(OmegaConf.select(tree, key, throw_on_missing=True)))
        except OmegaConfBaseException as exc:
            raise ValueError(f"{key}: {str(exc).splitlines()[0]}") from None


def _text_with_references(section: BaseModel, prefix: str):
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from _text_with_references(value, f"{prefix}{name}.")
        elif isinstance(value, str) and "${" in value:
            yield section, name, f"{prefix}{name}"


def checkpoint_contents(config: Config, which: Literal["save", "load"]) -> dict[str, list[str]]:
    """verl's checkpoint.save_contents / load_contents of each trained role, by its checkpoint directory."""
    sections = {"actor": config.actor_rollout_ref.actor.checkpoint, "critic": config.critic.checkpoint}
    return {role: list(getattr(section, f"{which}_contents")) for role, section in sections.items()}
