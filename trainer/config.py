"""The trainer's one typed configuration: verl's `main_ppo` key tree (what we support), every default here.

    config = load_config(["algorithm.adv_estimator=grpo", "trainer.logger=['console','jsonl']",
                          "--config", "run.yaml"])

`load_config` reads YAML files (applied first) and Hydra-style `key=value` overrides, names the closest
valid keys for an unknown one, and checks what verl checks before any work starts: batch-size
divisibility, paths that must exist, sane clip ratios. Keys verl has that mean nothing in this
project (FSDP offload knobs, vLLM engine knobs, ...) are accepted so verl scripts run unchanged; their
descriptions say "ignored". Components receive their own section (`config.actor_rollout_ref.actor`),
never the whole Config. Torch-free on purpose: the CLI, the docs and the launcher tests import it.

`python -m trainer.config --markdown` prints the configuration reference the README embeds.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]
Dtype = Literal["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]
SECRET_KEYS = frozenset({"services.auth_token"})


class ConfigError(ValueError):
    """Bad configuration: one problem per line, each naming the keys involved."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def ignored(default: Any, what: str, why: str = "no effect in this trainer") -> Any:
    """A verl key we accept so verl scripts run, but which changes nothing here."""
    return Field(
        default,
        description=f"{what} Accepted for verl compatibility; ignored ({why}).",
        json_schema_extra={"ignored": True},
    )


class Section(BaseModel):
    # protected_namespaces=(): verl names a key `model_dtype`.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ---------------------------------------------------------------------------------------- data


class CustomClass(Section):
    path: str | None = Field(
        None, description="File defining a custom dataset class. Not supported: must stay null."
    )
    name: str | None = Field(None, description="Class name in that file.")


class DataConfig(Section):
    source: Literal["files", "server"] | None = Field(
        None,
        description="Where prompts come from. null: `files` when data.train_files is set, else `server`.",
    )
    train_files: list[str] | None = Field(
        None,
        description="Training parquet/jsonl file(s) of verl rows (data.source=files). One path or a list.",
    )
    val_files: list[str] | None = Field(
        None, description="Validation parquet/jsonl file(s) (data.source=files). null: no validation set."
    )
    dataset: str = Field("gsm8k", description="Dataset name on the data-server (data.source=server).")
    train_split: str = Field("train", description="Data-server split used for training.")
    val_split: str | None = Field("test", description="Data-server split used for validation; null: none.")
    tokenizer: str | None = Field(
        None, description="Tokenizer path or hub id. null: the policy model's tokenizer."
    )
    prompt_key: str = Field("prompt", description="Row field holding the chat messages (or a plain string).")
    reward_fn_key: str = Field("data_source", description="Row field that selects the reward scorer.")
    max_prompt_length: int = Field(512, ge=1, description="Longest prompt in tokens, chat template included.")
    max_response_length: int = Field(512, ge=1, description="Most tokens generated per response.")
    train_batch_size: int = Field(
        1024, ge=1, description="Prompts per training step (responses: times rollout.n)."
    )
    val_batch_size: int | None = Field(
        None,
        ge=1,
        description="Prompts per validation generation call. null: the whole validation set at once.",
    )
    gen_batch_size: int | None = Field(
        None,
        ge=1,
        description="DAPO dynamic sampling: prompts generated per round. null: data.train_batch_size.",
    )
    shuffle: bool = Field(
        True,
        description="data.source=files: shuffle training prompts, a new seeded order every epoch "
        "(the data-server "
        "always shuffles, with its own --seed).",
    )
    seed: int | None = Field(
        None, description="data.source=files: seed of the epoch orders. null: trainer.seed."
    )
    filter_overlong_prompts: bool = Field(
        False, description="Drop prompts longer than data.max_prompt_length instead of truncating them."
    )
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error",
        description="A prompt longer than data.max_prompt_length: error stops the run; left keeps the end; "
        "right keeps the start; middle keeps both ends.",
    )
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of tokenizer.apply_chat_template, e.g. {enable_thinking: false}.",
    )
    trust_remote_code: bool = Field(False, description="Allow the tokenizer's own Python code (hub repos).")
    return_raw_chat: bool = ignored(
        False, "Return the chat messages with each prompt.", "records always carry them"
    )
    return_raw_input_ids: bool = ignored(False, "Return prompt ids without the chat template.")
    return_full_prompt: bool = ignored(False, "Return the templated prompt text.")
    validation_shuffle: bool = ignored(False, "Shuffle the validation set.", "validation order is fixed")
    use_shm: bool = ignored(False, "Load data through shared memory.")
    dataloader_num_workers: int = ignored(8, "Data loader worker processes.", "prompts are read in-process")
    filter_overlong_prompts_workers: int = ignored(1, "Processes used to filter overlong prompts.")
    image_key: str = ignored("images", "Row field of images.", "text only")
    video_key: str = ignored("videos", "Row field of videos.", "text only")
    custom_cls: CustomClass = Field(
        default_factory=CustomClass, description="Custom dataset class (unsupported)."
    )

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------- model / actor


class WrapPolicy(Section):
    min_num_params: int = ignored(0, "FSDP auto-wrap threshold.")
    transformer_layer_cls_to_wrap: list[str] | None = ignored(None, "FSDP wrap classes.")


class FSDPConfig(Section):
    param_offload: bool = ignored(False, "Offload parameters to CPU.", "single process, no FSDP yet")
    optimizer_offload: bool = ignored(False, "Offload optimizer state to CPU.", "single process, no FSDP yet")
    grad_offload: bool = ignored(
        False, "Offload gradients to CPU (old verl key).", "single process, no FSDP yet"
    )
    offload_policy: bool = ignored(False, "FSDP2 CPU offload policy.", "single process, no FSDP yet")
    reshard_after_forward: bool | int = ignored(True, "FSDP2 resharding.", "single process, no FSDP yet")
    fsdp_size: int = ignored(-1, "FSDP group size.", "single process, no FSDP yet")
    forward_prefetch: bool = ignored(False, "FSDP forward prefetch.", "single process, no FSDP yet")
    model_dtype: Dtype = Field(
        "fp32", description="dtype of the trained weights (fp32 keeps full-precision master weights)."
    )
    wrap_policy: WrapPolicy = Field(default_factory=WrapPolicy, description="FSDP wrapping (ignored).")


class ModelConfig(Section):
    path: str = Field(
        "Qwen/Qwen2.5-0.5B-Instruct", description="Policy weights: a hub id, a local folder, or a .gguf file."
    )
    custom_chat_template: str | None = Field(
        None, description="Jinja chat template replacing the tokenizer's."
    )
    trust_remote_code: bool = Field(False, description="Allow the model repo's own Python code.")
    override_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Values overriding the model's HF config, e.g. {attn_implementation: sdpa}.",
    )
    enable_gradient_checkpointing: bool = Field(
        True, description="Recompute activations in backward to save memory."
    )
    use_remove_padding: bool = ignored(
        False, "Padding-free (packed) forward passes.", "padded batches are used"
    )
    external_lib: str | None = ignored(None, "Python module imported before loading the model.")
    use_shm: bool = ignored(False, "Load weights through shared memory.")
    enable_activation_offload: bool = ignored(False, "Offload activations to CPU.")
    use_liger: bool = ignored(False, "Liger kernels.")
    use_fused_kernels: bool = ignored(False, "Fused logprob kernels.", "logprobs are computed in chunks")
    lora_rank: int = Field(0, ge=0, description="LoRA rank. Only 0 (full fine-tuning) is supported.")
    lora_alpha: int = ignored(16, "LoRA alpha.", "LoRA unsupported")
    target_modules: str | list[str] = ignored("all-linear", "LoRA target modules.", "LoRA unsupported")
    exclude_modules: str | None = ignored(None, "LoRA excluded modules.", "LoRA unsupported")


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_warmup_steps: int | None = Field(
        -1, description="Linear warm-up steps; wins over the ratio. -1 or null: use lr_warmup_steps_ratio."
    )
    lr_warmup_steps_ratio: float = Field(
        0.0, ge=0, le=1, description="Warm-up steps as a fraction of all steps."
    )
    lr_scheduler_type: Literal["constant", "cosine"] = Field(
        "constant", description="Schedule after warm-up."
    )
    warmup_style: Literal["constant", "cosine"] | None = Field(
        None, description="Older verl name of lr_scheduler_type; when set it wins."
    )
    min_lr_ratio: float | None = Field(
        0.0, ge=0, le=1, description="cosine: final lr as a fraction of lr (null: 0)."
    )
    num_cycles: float = Field(
        0.5, gt=0, description="cosine: cycles over training (0.5 decays once to the minimum)."
    )
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    optimizer: Literal["AdamW"] = Field("AdamW", description="Optimizer class (only AdamW).")
    total_training_steps: int = ignored(
        -1, "Steps of the schedule.", "set from trainer.total_training_steps at run time"
    )
    clip_grad: float | None = ignored(
        None, "Newer verl spelling of grad_clip.", "use the section's grad_clip"
    )


class CheckpointContents(Section):
    save_contents: list[str] = ignored(
        ["model", "optimizer", "extra"], "What a checkpoint holds.", "always everything"
    )
    load_contents: list[str] | None = ignored(None, "What to load from a checkpoint.", "always everything")
    contents: list[str] | None = ignored(None, "Older verl name of save_contents.", "always everything")
    async_save: bool = ignored(False, "Save checkpoints asynchronously (Megatron).")


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla"] = Field("vanilla", description="Policy loss: PPO clip (vanilla) only.")


class ActorConfig(Section):
    strategy: Literal["fsdp", "fsdp2"] = Field(
        "fsdp", description="Training backend name (single process today)."
    )
    ppo_mini_batch_size: int = Field(
        256,
        ge=1,
        description="Prompts per optimizer step; each step updates on this many prompts * rollout.n "
        "sequences.",
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward/backward on one GPU (gradient accumulation). "
        "null: the whole per-GPU mini-batch at once.",
    )
    ppo_micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Deprecated global micro-batch: divided by the GPU count into "
        "ppo_micro_batch_size_per_gpu.",
    )
    use_dynamic_bsz: bool = ignored(False, "Token-budget micro-batches.", "micro-batches are formed by count")
    ppo_max_token_len_per_gpu: int = ignored(16384, "Token budget of a dynamic micro-batch.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch of rollouts.")
    shuffle: bool = Field(False, description="Reshuffle sequences between PPO epochs.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    clip_ratio: float = Field(
        0.2, gt=0, lt=1, description="PPO clip epsilon; default of clip_ratio_low/high."
    )
    clip_ratio_low: float | None = Field(
        None, ge=0, lt=1, description="Lower clip: the ratio is kept >= 1 - this. null: clip_ratio."
    )
    clip_ratio_high: float | None = Field(
        None,
        ge=0,
        description="Upper clip: the ratio is kept <= 1 + this (DAPO clip-higher). null: clip_ratio.",
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, description="Dual-clip constant: bounds the loss of negative advantages."
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="How token losses are averaged into one number."
    )
    loss_scale_factor: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm (Dr.GRPO) divisor. null: data.max_response_length."
    )
    entropy_coeff: float = Field(0.0, description="Weight of the entropy bonus (subtracted from the loss).")
    use_kl_loss: bool = Field(False, description="Add KL(policy || reference) to the loss (GRPO style).")
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss.")
    kl_loss_type: KLType = Field(
        "low_var_kl", description="KL estimator of the loss: kl/k1, abs, mse/k2, low_var_kl/k3."
    )
    policy_loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig, description="Policy loss variant."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    checkpoint: CheckpointContents = Field(
        default_factory=CheckpointContents, description="Checkpoint contents."
    )
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP settings (mostly ignored).")
    use_torch_compile: bool = ignored(True, "torch.compile the model.")
    ulysses_sequence_parallel_size: int = ignored(1, "Sequence parallel size.", "no sequence parallelism")
    entropy_from_logits_with_chunking: bool = ignored(False, "Chunked entropy.", "always chunked")
    entropy_checkpointing: bool = ignored(False, "Recompute entropy in backward.")
    use_remove_padding: bool = ignored(False, "Padding-free forward passes.")
    use_fused_kernels: bool = ignored(False, "Fused logprob kernels.")


# ---------------------------------------------------------------------------------------- rollout / ref


class ValKwargs(Section):
    temperature: float = Field(0.0, ge=0, description="Validation sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Validation nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Validation top-k (-1 or 0: off).")
    n: int = Field(1, ge=1, description="Responses per validation prompt.")
    do_sample: bool = Field(False, description="Sample during validation; false: greedy.")


class MultiTurnConfig(Section):
    enable: bool = Field(
        False, description="Multi-turn tool-calling rollouts. Not supported yet: must stay false."
    )
    max_assistant_turns: int | None = ignored(None, "Turn limit.", "multi-turn unsupported")
    max_user_turns: int | None = ignored(None, "User turn limit.", "multi-turn unsupported")
    max_turns: int | None = ignored(None, "Older turn limit.", "multi-turn unsupported")
    tool_config_path: str | None = ignored(None, "Tool config file.", "multi-turn unsupported")
    interaction_config_path: str | None = ignored(None, "Interaction config file.", "multi-turn unsupported")
    max_parallel_calls: int = ignored(1, "Parallel tool calls.", "multi-turn unsupported")
    max_tool_response_length: int = ignored(256, "Tool response length.", "multi-turn unsupported")
    tool_response_truncate_side: str = ignored(
        "middle", "Tool response truncation.", "multi-turn unsupported"
    )
    use_inference_chat_template: bool = ignored(False, "Chat template choice.", "multi-turn unsupported")
    tokenization_sanity_check_mode: str = ignored("strict", "Tokenization check.", "multi-turn unsupported")
    format: str = ignored("hermes", "Tool call format.", "multi-turn unsupported")


class RolloutConfig(Section):
    name: Literal["hf", "builtin", "sglang", "vllm"] = Field(
        "hf",
        description="Generation engine. hf: transformers generate (the built-in engine today); builtin: the "
        "project's own engine; sglang / vllm: external engines, run by the built-in engine until wired in.",
    )
    mode: Literal["sync", "async"] = ignored("sync", "Engine call style.", "the engine is called in-process")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 or 0: off).")
    do_sample: bool = Field(True, description="Sample; false: greedy decoding.")
    n: int = Field(1, ge=1, description="Responses per prompt (the group size of GRPO/RLOO; > 1 for them).")
    prompt_length: int | None = Field(
        None, ge=1, description="Longest prompt for the engine. null: data.max_prompt_length."
    )
    response_length: int | None = Field(
        None, ge=1, description="Most new tokens per response. null: data.max_response_length."
    )
    stop: list[str] = Field(default_factory=list, description="Strings that end a response (kept in it).")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a response, besides EOS."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")
    tensor_model_parallel_size: int = Field(
        1, ge=1, description="Engine tensor parallel size; must divide the GPU count."
    )
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward when recomputing old logprobs. null: actor's micro-batch.",
    )
    log_prob_micro_batch_size: int | None = Field(
        None, ge=1, description="Deprecated global form of log_prob_micro_batch_size_per_gpu."
    )
    log_prob_use_dynamic_bsz: bool = ignored(False, "Token-budget logprob micro-batches.")
    log_prob_max_token_len_per_gpu: int = ignored(16384, "Token budget of a logprob micro-batch.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Share of GPU memory an external engine may take."
    )
    dtype: str = ignored("bfloat16", "Engine dtype.", "follows the policy")
    enforce_eager: bool = ignored(False, "Disable CUDA graphs in the engine.")
    free_cache_engine: bool = ignored(True, "Free the KV cache between steps.")
    load_format: str = ignored("dummy_dtensor", "How the engine loads weights.")
    max_num_batched_tokens: int = ignored(8192, "Engine batch token budget.")
    max_model_len: int | None = ignored(None, "Engine context length.")
    max_num_seqs: int = ignored(1024, "Engine concurrent sequences.")
    enable_chunked_prefill: bool = ignored(True, "Engine chunked prefill.")
    disable_log_stats: bool = ignored(True, "Engine statistics logging.")
    calculate_log_probs: bool = ignored(False, "Engine-side logprobs.", "the engine always returns them")
    layered_summon: bool = ignored(False, "Layered weight gathering.")
    update_weights_bucket_megabytes: int = ignored(512, "Weight sync bucket size.")
    over_sample_rate: float = ignored(0.0, "Over-sampling for early abort.")
    multi_stage_wake_up: bool = ignored(False, "Staged memory wake-up.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra engine arguments (external engines)."
    )
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="Sampling used for validation.")
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="Multi-turn rollouts (unsupported)."
    )


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="Sequences per reference forward. null: the actor's micro-batch."
    )
    log_prob_micro_batch_size: int | None = Field(
        None, ge=1, description="Deprecated global form of log_prob_micro_batch_size_per_gpu."
    )
    log_prob_use_dynamic_bsz: bool = ignored(False, "Token-budget micro-batches.")
    log_prob_max_token_len_per_gpu: int = ignored(16384, "Token budget of a micro-batch.")
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP settings (mostly ignored).")
    strategy: Literal["fsdp", "fsdp2"] = ignored("fsdp", "Reference backend.", "follows the actor")
    use_torch_compile: bool = ignored(True, "torch.compile the reference.")
    ulysses_sequence_parallel_size: int = ignored(1, "Sequence parallel size.")
    entropy_from_logits_with_chunking: bool = ignored(False, "Chunked entropy.")
    entropy_checkpointing: bool = ignored(False, "Entropy recomputation.")


class ActorRolloutRefConfig(Section):
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The policy model (also the reference)."
    )
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy training.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    ref: RefConfig = Field(default_factory=RefConfig, description="Frozen reference policy for the KL terms.")
    hybrid_engine: bool = ignored(True, "Actor and rollout share GPUs.", "always colocated")
    nccl_timeout: int = ignored(600, "NCCL timeout in seconds.")


# ---------------------------------------------------------------------------------------- critic / reward


class CriticModelConfig(Section):
    path: str | None = Field(
        None, description="Critic weights (a value head is added). null: the policy model's path."
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer of the critic. null: the policy's.")
    override_config: dict[str, Any] = Field(
        default_factory=dict, description="HF config overrides of the critic."
    )
    trust_remote_code: bool | None = Field(
        None, description="null: actor_rollout_ref.model.trust_remote_code."
    )
    enable_gradient_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP settings (mostly ignored).")
    external_lib: str | None = ignored(None, "Module imported before loading.")
    use_remove_padding: bool = ignored(False, "Padding-free forward passes.")
    enable_activation_offload: bool = ignored(False, "Activation offload.")
    use_shm: bool = ignored(False, "Shared-memory loading.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank. Only 0 is supported.")
    lora_alpha: int = ignored(16, "LoRA alpha.", "LoRA unsupported")
    target_modules: str | list[str] = ignored("all-linear", "LoRA targets.", "LoRA unsupported")


class CriticConfig(Section):
    enable: bool | None = Field(
        None, description="Train a critic. null: only when algorithm.adv_estimator=gae."
    )
    strategy: Literal["fsdp", "fsdp2"] = Field("fsdp", description="Training backend name.")
    model: CriticModelConfig = Field(default_factory=CriticModelConfig, description="The value model.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description="Critic optimizer.")
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Prompts per critic optimizer step. null: actor_rollout_ref.actor.ppo_mini_batch_size.",
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Sequences per critic forward/backward on one GPU. null: the whole per-GPU mini-batch.",
    )
    ppo_micro_batch_size: int | None = Field(None, ge=1, description="Deprecated global critic micro-batch.")
    forward_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="Sequences per value forward. null: critic.ppo_micro_batch_size_per_gpu."
    )
    forward_micro_batch_size: int | None = Field(
        None, ge=1, description="Deprecated global form of the above."
    )
    use_dynamic_bsz: bool | None = ignored(None, "Token-budget micro-batches.")
    ppo_max_token_len_per_gpu: int = ignored(32768, "Token budget of a micro-batch.")
    forward_max_token_len_per_gpu: int | None = ignored(None, "Token budget of a forward micro-batch.")
    ppo_epochs: int | None = Field(
        None, ge=1, description="Critic passes per batch. null: the actor's ppo_epochs."
    )
    shuffle: bool | None = Field(None, description="Reshuffle between epochs. null: the actor's shuffle.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's gradient norm.")
    cliprange_value: float = Field(
        0.5, gt=0, description="Value clipping: new values stay within old +- this."
    )
    loss_agg_mode: LossAggMode | None = Field(None, description="Value loss aggregation. null: the actor's.")
    rollout_n: int | None = Field(None, ge=1, description="Set from actor_rollout_ref.rollout.n; do not set.")
    checkpoint: CheckpointContents = Field(
        default_factory=CheckpointContents, description="Checkpoint contents."
    )
    ulysses_sequence_parallel_size: int = ignored(1, "Sequence parallel size.")


class OverlongBuffer(Section):
    enable: bool = Field(False, description="DAPO overlong penalty on responses near the length limit.")
    len: int = Field(
        0, ge=0, description="Buffer before max_response_length where the penalty grows linearly."
    )
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at the length limit.")
    log: bool = Field(False, description="Log the penalty as a metric.")


class RewardModelWeights(Section):
    path: str | None = ignored(None, "Reward model weights.", "the reward-server runs reward models")
    input_tokenizer: str | None = ignored(None, "Reward model tokenizer.")
    external_lib: str | None = ignored(None, "Module imported before loading.")
    trust_remote_code: bool = ignored(False, "Remote code of the reward model.")
    use_remove_padding: bool = ignored(False, "Padding-free forward passes.")
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP settings (ignored).")


class RewardModelConfig(Section):
    mode: Literal["server", "local"] = Field(
        "server", description="server: score through the reward-server; local: the same scorers in-process."
    )
    overlong_buffer: OverlongBuffer = Field(
        default_factory=OverlongBuffer, description="DAPO overlong penalty."
    )
    gsm8k_method: Literal["strict", "flexible"] = Field(
        "strict",
        description="GSM8K answers: strict = the last '#### N' (verl's default); flexible = the last number.",
    )
    format_score: float = Field(
        0.0, description="Score of an answer that was found but is wrong (verl's format_score)."
    )
    enable: bool = ignored(
        False, "A model-based reward model worker.", "the reward-server chooses the scorer"
    )
    reward_manager: str = ignored(
        "naive", "verl reward manager (naive, dapo, prime, batch).", "scoring is batched"
    )
    launch_reward_fn_async: bool = ignored(False, "Score asynchronously.", "scoring is always async")
    strategy: str = ignored("fsdp", "Reward model backend.")
    model: RewardModelWeights = Field(
        default_factory=RewardModelWeights, description="Reward model (ignored)."
    )
    micro_batch_size: int | None = ignored(None, "Reward model micro-batch.")
    micro_batch_size_per_gpu: int | None = ignored(None, "Reward model micro-batch per GPU.")
    max_length: int | None = ignored(None, "Reward model context length.")
    use_dynamic_bsz: bool | None = ignored(None, "Token-budget batches.")
    forward_max_token_len_per_gpu: int | None = ignored(None, "Token budget.")
    ulysses_sequence_parallel_size: int = ignored(1, "Sequence parallel size.")


class CustomRewardFunction(Section):
    path: str | None = Field(
        None,
        description="Python file with a verl-style compute_score(data_source, solution_str, ground_truth, "
        "extra_info); used by reward_model.mode=local instead of the built-in scorers.",
    )
    name: str = Field("compute_score", description="Function name in that file.")


# ---------------------------------------------------------------------------------------- algorithm / trainer


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="KL-in-reward coefficient: fixed or adaptive."
    )
    kl_coef: float = Field(0.001, ge=0, description="(Initial) KL-in-reward coefficient.")
    horizon: int = Field(10000, gt=0, description="adaptive: steps over which the coefficient adapts.")
    target_kl: float = Field(0.1, ge=0, description="adaptive: KL the controller steers to.")


class FilterGroupsConfig(Section):
    enable: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose scores are all equal, refill."
    )
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field(
        "acc", description="Per-response value whose zero variance drops a group."
    )
    max_num_gen_batches: int = Field(0, description="Most generation rounds per step; <= 0: no limit.")


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = Field("gae", description="Advantage estimator; gae trains a critic (PPO).")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="GRPO: divide by the group's std (false: Dr.GRPO)."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (gae, reinforce_plus_plus).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    use_kl_in_reward: bool = Field(False, description="Subtract a KL penalty from the token rewards.")
    kl_penalty: KLType = Field("kl", description="KL estimator used in the reward.")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="KL-in-reward controller.")
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig, description="DAPO dynamic sampling."
    )
    use_pf_ppo: bool = ignored(False, "Preference-feedback PPO reweighting.")


class TrainerConfig(Section):
    project_name: str = Field("verl_examples", description="Project name (tracking, checkpoint folder).")
    experiment_name: str = Field("gsm8k", description="Run name (tracking, checkpoint folder).")
    logger: list[Logger] = Field(
        default_factory=lambda: ["console"],
        description="Metric sinks: console, jsonl, tensorboard, wandb, swanlab.",
    )
    log_val_generations: int = Field(
        0, ge=0, description="Validation samples (prompt, response, score) logged each time."
    )
    nnodes: int = Field(1, ge=1, description="Machines.")
    n_gpus_per_node: int = Field(1, ge=1, description="GPUs per machine.")
    use_ray: bool | None = Field(
        None,
        description="Train with Ray role groups (FSDP2, one rank per GPU). null: when nnodes x "
        "n_gpus_per_node > 1; false: one process (CPU debugging, the offline demo).",
    )
    role_pools: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: policy, rollout, reference and critic share every GPU; "
        "separate: each role gets its own nnodes x n_gpus_per_node GPUs.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: cuda when available, else cpu.")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Forward/backward precision (weights and optimizer stay fp32). "
        "auto: bf16 autocast on CUDA, "
        "fp32 on CPU; bf16 on a CPU with AMX / AVX512-BF16 is ~3x faster.",
    )
    seed: int = Field(
        1, description="Seed of python, numpy and torch RNGs (and of data order unless data.seed)."
    )
    total_epochs: int = Field(30, ge=1, description="Passes over the training prompts.")
    total_training_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps (wins over epochs)."
    )
    save_freq: int = Field(
        -1, ge=-1, description="Checkpoint every N steps (and at the end); -1 or 0: never."
    )
    test_freq: int = Field(-1, ge=-1, description="Validate every N steps (and at the end); -1 or 0: never.")
    val_before_train: bool = Field(True, description="Validate once before the first step.")
    val_only: bool = Field(False, description="Validate and exit without training.")
    critic_warmup: int = Field(
        0, ge=0, description="Steps that train only the critic before the actor starts."
    )
    default_local_dir: str = Field(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        description="Checkpoint root folder.",
    )
    log_dir: str = Field(
        "runs/${trainer.project_name}/${trainer.experiment_name}",
        description="Run folder: JSONL metrics, TensorBoard events, generations, report PNGs.",
    )
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        "auto",
        description="auto: resume from the latest checkpoint if any; resume_path: from resume_from_path.",
    )
    resume_from_path: str | None = Field(
        None, description="A global_step_N folder (resume_mode=resume_path)."
    )
    max_actor_ckpt_to_keep: int | None = Field(
        None, ge=1, description="Keep the last K checkpoints; null: all."
    )
    max_critic_ckpt_to_keep: int | None = Field(None, ge=1, description="Critic counterpart (null: all).")
    rollout_data_dir: str | None = Field(None, description="Folder for JSONL dumps of every step's rollouts.")
    validation_data_dir: str | None = Field(
        None, description="Folder for JSONL dumps of validation generations."
    )
    balance_batch: bool = ignored(True, "Balance tokens across data-parallel ranks.", "single process")
    default_hdfs_dir: str | None = ignored(None, "HDFS copy of checkpoints.")
    del_local_ckpt_after_load: bool = ignored(False, "Delete a checkpoint after loading it.")
    esi_redundant_time: float = ignored(0, "Expected preemption margin.")
    ray_wait_register_center_timeout: int = ignored(300, "Ray registration timeout.")
    use_legacy_worker_impl: str = ignored("auto", "verl worker implementation.")

    @field_validator("logger", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def _env_urls(var: str, fallback: str):
    def read() -> list[str]:
        return _split_urls(os.environ.get(var) or fallback)

    return read


def _split_urls(value: Any) -> Any:
    if isinstance(value, str):
        return [url.strip() for url in value.split(",") if url.strip()]
    return value


class ServicesConfig(Section):
    data_url: list[str] = Field(
        default_factory=_env_urls("DATA_SERVER_URL", "http://127.0.0.1:8000"),
        description="data-server URL(s); several (comma-separated or a list) are replicas.",
        json_schema_extra={"env": "DATA_SERVER_URL", "fallback": "http://127.0.0.1:8000"},
    )
    reward_url: list[str] = Field(
        default_factory=_env_urls("REWARD_SERVER_URL", "http://127.0.0.1:8001"),
        description="reward-server URL(s) (reward_model.mode=server).",
        json_schema_extra={"env": "REWARD_SERVER_URL", "fallback": "http://127.0.0.1:8001"},
    )
    retrieval_url: list[str] = Field(
        default_factory=_env_urls("RETRIEVAL_SERVER_URL", "http://127.0.0.1:8002"),
        description="retrieval-server URL(s) (search tools).",
        json_schema_extra={"env": "RETRIEVAL_SERVER_URL", "fallback": "http://127.0.0.1:8002"},
    )
    auth_token: str | None = Field(None, description="Bearer token sent to every service (never printed).")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one HTTP request.")
    retries: int = Field(5, ge=0, description="Retries of a failed request (jittered exponential backoff).")
    health_timeout_s: float = Field(
        60.0, gt=0, description="At start, how long to wait for a needed service's /health."
    )

    @field_validator("data_url", "reward_url", "retrieval_url", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> Any:
        return _split_urls(value)


# ---------------------------------------------------------------------------------------- the whole config


class Config(Section):
    """Everything a training run needs; verl's `main_ppo` key names plus `services`."""

    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="Policy."
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (PPO with gae).")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Rewards.")
    custom_reward_function: CustomRewardFunction = Field(
        default_factory=CustomRewardFunction, description="User scoring function (local rewards)."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Run control.")
    services: ServicesConfig = Field(default_factory=ServicesConfig, description="Our HTTP services.")
    # Deprecated/current key pairs both given by the user, noticed before fill_derived sets the current one.
    _conflicts: list[str] = PrivateAttr(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def use_critic(self) -> bool:
        return bool(self.critic.enable)

    @property
    def use_reference(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @model_validator(mode="after")
    def _fill_derived(self) -> Config:
        self._conflicts = _deprecated_conflicts(self)
        fill_derived(self)
        resolve_string_references(self)
        return self

    def to_dict(self, *, mask_secrets: bool = True) -> dict[str, Any]:
        tree = self.model_dump(mode="json")
        if mask_secrets:
            for key in SECRET_KEYS:
                section, _, leaf = key.rpartition(".")
                if tree[section][leaf] is not None:
                    tree[section][leaf] = "***"
        return tree

    def resolved_yaml(self) -> str:
        """The resolved configuration as YAML (secrets masked): what the run will actually use."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    def problems(self) -> list[str]:
        """Everything wrong with this configuration for a real run (empty when it is fine)."""
        return [
            *self._conflicts,
            *_batch_size_problems(self),
            *_path_problems(self),
            *_algorithm_problems(self),
        ]


# ---------------------------------------------------------------------------------------- derived values


def _per_gpu(global_size: int | None, world: int) -> int | None:
    """verl's deprecated global micro-batch turned into a per-GPU one (None if it does not divide)."""
    if global_size is None or global_size % world:
        return None
    return global_size // world


def fill_derived(config: Config) -> None:
    """Turn every `null: <rule>` default into its concrete value, so the printed config is what runs."""
    data, arr, critic = config.data, config.actor_rollout_ref, config.critic
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    world, n = config.world_size, rollout.n
    if data.source is None:
        data.source = "files" if data.train_files else "server"
    data.seed = config.trainer.seed if data.seed is None else data.seed
    data.gen_batch_size = data.gen_batch_size or data.train_batch_size
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    for optim in (actor.optim, critic.optim):
        optim.lr_scheduler_type = optim.warmup_style or optim.lr_scheduler_type
        optim.min_lr_ratio = optim.min_lr_ratio or 0.0
    _adopt_global(actor, "ppo_micro_batch_size", world, _per_gpu(actor.ppo_mini_batch_size * n, world))
    for section in (rollout, ref):
        _adopt_global(section, "log_prob_micro_batch_size", world, actor.ppo_micro_batch_size_per_gpu)
    _fill_critic(config)
    _expand_home(config)


def _expand_home(config: Config) -> None:
    """`~/...` paths become absolute once, so no consumer has to remember expanduser."""

    def expand(path: str | None) -> str | None:
        return os.path.expanduser(path) if path and path.startswith("~") else path

    data, arr, trainer = config.data, config.actor_rollout_ref, config.trainer
    data.train_files = [expand(f) for f in data.train_files] if data.train_files else data.train_files
    data.val_files = [expand(f) for f in data.val_files] if data.val_files else data.val_files
    data.tokenizer = expand(data.tokenizer)
    arr.model.path = expand(arr.model.path)
    config.critic.model.path = expand(config.critic.model.path)
    config.critic.model.tokenizer_path = expand(config.critic.model.tokenizer_path)
    config.custom_reward_function.path = expand(config.custom_reward_function.path)
    trainer.resume_from_path = expand(trainer.resume_from_path)
    trainer.default_local_dir = expand(trainer.default_local_dir)
    trainer.log_dir = expand(trainer.log_dir)


def _adopt_global(section: Section, old: str, world: int, fallback: int | None) -> None:
    """Set `<old>_per_gpu` from verl's deprecated global `<old>` (which is then cleared), else `fallback`.

    A global size that does not split over the GPUs stays put for Config.problems() to report.
    """
    new = f"{old}_per_gpu"
    if getattr(section, new) is not None:
        return
    per_gpu = _per_gpu(getattr(section, old), world)
    if per_gpu is not None:
        setattr(section, old, None)
    setattr(section, new, per_gpu or fallback)


def _fill_critic(config: Config) -> None:
    critic, arr = config.critic, config.actor_rollout_ref
    actor, world, n = arr.actor, config.world_size, arr.rollout.n
    if critic.enable is None:
        critic.enable = config.algorithm.adv_estimator == "gae"
    critic.rollout_n = n
    critic.model.path = critic.model.path or arr.model.path
    critic.model.tokenizer_path = critic.model.tokenizer_path or config.data.tokenizer or arr.model.path
    if critic.model.trust_remote_code is None:
        critic.model.trust_remote_code = arr.model.trust_remote_code
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    critic.shuffle = actor.shuffle if critic.shuffle is None else critic.shuffle
    critic.loss_agg_mode = critic.loss_agg_mode or actor.loss_agg_mode
    critic.use_dynamic_bsz = (
        actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
    )
    _adopt_global(critic, "ppo_micro_batch_size", world, _per_gpu(critic.ppo_mini_batch_size * n, world))
    _adopt_global(critic, "forward_micro_batch_size", world, critic.ppo_micro_batch_size_per_gpu)


_REFERENCE = re.compile(r"\$\{([^${}]+)\}")


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            raise KeyError(dotted)
        tree = tree[part]
    return tree


def interpolate(text: str, tree: dict, _seen: tuple[str, ...] = ()) -> Any:
    """Resolve `${a.b}`, `${oc.env:VAR,default}` and `${oc.select:a.b,default}` in `text` against `tree`.

    A text that is exactly one reference takes the referenced value's type; otherwise values are
    spliced in as text. Raises ValueError naming a reference that leads nowhere or in a circle.
    """

    def value_of(expr: str) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            name, _, default = expr[len("oc.env:") :].partition(",")
            return os.environ.get(name.strip(), default.strip() if default else None)
        fallback_given = expr.startswith("oc.select:")
        if fallback_given:
            expr, _, fallback = expr[len("oc.select:") :].partition(",")
            expr = expr.strip()
        if expr in _seen:
            raise ValueError(f"'${{{expr}}}' refers to itself through {' -> '.join(_seen)}")
        try:
            found = _lookup(tree, expr)
        except KeyError:
            if fallback_given:
                return parse_value(fallback) if fallback else None
            raise ValueError(f"'${{{expr}}}' names no configuration key") from None
        return interpolate(found, tree, (*_seen, expr)) if isinstance(found, str) else found

    whole = _REFERENCE.fullmatch(text)
    if whole:
        return value_of(whole.group(1))
    return _REFERENCE.sub(lambda m: str(value_of(m.group(1))), text)


def resolve_string_references(config: Config) -> None:
    """Resolve `${...}` in every string field (e.g. the checkpoint folder) against the config itself."""
    tree = config.model_dump()

    def walk(section: BaseModel, prefix: str) -> None:
        for name in type(section).model_fields:
            value = getattr(section, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            elif isinstance(value, (str, list)) and "${" in str(value):
                key = f"{prefix}{name}"
                try:
                    if isinstance(value, str):
                        setattr(section, name, str(interpolate(value, tree, (key,))))
                    else:
                        setattr(
                            section,
                            name,
                            [str(interpolate(v, tree, (key,))) if isinstance(v, str) else v for v in value],
                        )
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None

    walk(config, "")


# ---------------------------------------------------------------------------------------- checks


def _mini_batch_problems(
    prefix: str, mini: int, micro_per_gpu: int | None, micro_global: int | None, config: Config
) -> list[str]:
    """verl's checks of one trained model's mini/micro batch sizes (actor or critic)."""
    batch, n, world = config.data.train_batch_size, config.actor_rollout_ref.rollout.n, config.world_size
    where = f"{world} GPU(s) (trainer.nnodes * trainer.n_gpus_per_node)"
    problems = []
    if mini > batch:
        problems.append(
            f"{prefix}.ppo_mini_batch_size ({mini}) is larger than data.train_batch_size ({batch})"
        )
    elif batch % mini:
        problems.append(
            f"data.train_batch_size ({batch}) must be divisible by {prefix}.ppo_mini_batch_size ({mini})"
        )
    if (mini * n) % world:
        problems.append(
            f"{prefix}.ppo_mini_batch_size * actor_rollout_ref.rollout.n = {mini * n} sequences must "
            "split evenly "
            f"over {where}"
        )
    elif micro_global is not None and micro_global % world:
        problems.append(
            f"{prefix}.ppo_micro_batch_size ({micro_global}, deprecated, global) must split over {where}"
        )
    elif micro_per_gpu is not None and (mini * n // world) % micro_per_gpu:
        problems.append(
            f"{prefix}.ppo_mini_batch_size * actor_rollout_ref.rollout.n / GPUs = {mini * n // world} "
            "sequences per "
            f"GPU must be divisible by {prefix}.ppo_micro_batch_size_per_gpu ({micro_per_gpu})"
        )
    return problems


def _deprecated_conflicts(config: Config) -> list[str]:
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


def _batch_size_problems(config: Config) -> list[str]:
    arr, critic, data = config.actor_rollout_ref, config.critic, config.data
    actor, rollout, n, world = arr.actor, arr.rollout, arr.rollout.n, config.world_size
    problems = []
    if (data.train_batch_size * n) % world:
        problems.append(
            f"data.train_batch_size * actor_rollout_ref.rollout.n = {data.train_batch_size * n} "
            "responses per step "
            f"must split evenly over {world} GPU(s) (trainer.nnodes * trainer.n_gpus_per_node)"
        )
    problems += _mini_batch_problems(
        "actor_rollout_ref.actor",
        actor.ppo_mini_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        actor.ppo_micro_batch_size,
        config,
    )
    if config.use_critic:
        problems += _mini_batch_problems(
            "critic",
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
            critic.ppo_micro_batch_size,
            config,
        )
    if world % rollout.tensor_model_parallel_size:
        problems.append(
            "actor_rollout_ref.rollout.tensor_model_parallel_size "
            f"({rollout.tensor_model_parallel_size}) must divide "
            f"the {world} GPU(s) (trainer.nnodes * trainer.n_gpus_per_node)"
        )
    if config.algorithm.filter_groups.enable and data.gen_batch_size < data.train_batch_size:
        problems.append(
            f"data.gen_batch_size ({data.gen_batch_size}) must be at least data.train_batch_size "
            f"({data.train_batch_size})"
        )
    return problems


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or path in (".", "..")


def model_path_problem(key: str, path: str) -> str | None:
    """None when `path` is an existing model folder or .gguf file, or has the shape of a hub id
    (`org/name`, or `org/name/file.gguf` for a GGUF file in a hub repo); else what is wrong."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists() and not any(local.glob("*.gguf")):
            return f"{key}: folder {path} holds neither config.json nor a .gguf file"
        return None
    if local.is_file():
        return None if local.suffix == ".gguf" else f"{key}: {path} is a file but not a .gguf file"
    hub_shaped = path.count("/") >= 2 if path.endswith(".gguf") else path.count("/") <= 1
    if path and hub_shaped and not _looks_local(path):
        return None
    return (
        f"{key}: {path} does not exist (give a local folder, a .gguf file or a hub id like "
        "Qwen/Qwen2.5-0.5B-Instruct)"
    )


def _file_problems(key: str, files: list[str] | None) -> list[str]:
    problems = []
    for file in files or []:
        path = Path(file).expanduser()
        if not path.is_file():
            problems.append(f"{key}: {file} does not exist")
        elif path.suffix not in (".parquet", ".jsonl", ".json"):
            problems.append(f"{key}: {file} is not a .parquet or .jsonl file")
    return problems


def _path_problems(config: Config) -> list[str]:
    data, arr = config.data, config.actor_rollout_ref
    problems: list[str | None] = []
    if data.source == "files":
        if not data.train_files:
            problems.append("data.source=files needs data.train_files")
        problems += _file_problems("data.train_files", data.train_files)
        problems += _file_problems("data.val_files", data.val_files)
    else:
        for key in ("train_files", "val_files"):
            if getattr(data, key):
                problems.append(f"data.{key} is set but data.source=server reads from the data-server")
        if not config.services.data_url:
            problems.append("data.source=server needs services.data_url (or env DATA_SERVER_URL)")
    if config.reward_model.mode == "server" and not config.services.reward_url:
        problems.append("reward_model.mode=server needs services.reward_url (or env REWARD_SERVER_URL)")
    problems.append(model_path_problem("actor_rollout_ref.model.path", arr.model.path))
    if data.tokenizer:
        problems.append(model_path_problem("data.tokenizer", data.tokenizer))
    if config.use_critic and config.critic.model.path != arr.model.path:
        problems.append(model_path_problem("critic.model.path", config.critic.model.path or ""))
    reward_file = config.custom_reward_function.path
    if reward_file and not Path(reward_file).expanduser().is_file():
        problems.append(f"custom_reward_function.path: {reward_file} does not exist")
    trainer = config.trainer
    if trainer.resume_mode == "resume_path":
        if not trainer.resume_from_path:
            problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        elif not Path(trainer.resume_from_path).expanduser().is_dir():
            problems.append(f"trainer.resume_from_path: {trainer.resume_from_path} is not a folder")
    return [p for p in problems if p]


def _algorithm_problems(config: Config) -> list[str]:
    arr, algo, data = config.actor_rollout_ref, config.algorithm, config.data
    problems = []
    if algo.adv_estimator == "gae" and not config.use_critic:
        problems.append("algorithm.adv_estimator=gae needs a critic, but critic.enable=false")
    if algo.filter_groups.enable and arr.rollout.n < 2:
        problems.append(
            "algorithm.filter_groups.enable needs actor_rollout_ref.rollout.n >= 2 (a group of one "
            "never varies)"
        )
    if arr.rollout.n > 1 and not arr.rollout.do_sample:
        problems.append("actor_rollout_ref.rollout.n > 1 with do_sample=false gives n identical responses")
    if algo.kl_ctrl.type == "adaptive" and algo.kl_ctrl.target_kl <= 0:
        problems.append("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0")
    buffer = config.reward_model.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= data.max_response_length:
        problems.append(
            f"reward_model.overlong_buffer.len ({buffer.len}) must be in 1..data.max_response_length "
            f"({data.max_response_length})"
        )
    unsupported = {
        "actor_rollout_ref.model.lora_rank": arr.model.lora_rank != 0,
        "critic.model.lora_rank": config.critic.model.lora_rank != 0,
        "actor_rollout_ref.rollout.multi_turn.enable": arr.rollout.multi_turn.enable,
        "data.custom_cls.path": data.custom_cls.path is not None,
    }
    problems += [
        f"{key}: not supported by this trainer (leave it at its default)"
        for key, bad in unsupported.items()
        if bad
    ]
    return problems


# ---------------------------------------------------------------------------------------- parsing


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are outside quotes and brackets."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if quote or depth:
        raise ValueError(f"unbalanced quotes or brackets in {text!r}")
    tail = "".join(current)
    return parts + [tail] if (parts or tail.strip()) else []


_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


def parse_value(text: str, *, typed: bool = True) -> Any:
    """A command-line value the way Hydra reads it: null/None/~, booleans, numbers, [lists], {maps}, 'quoted'.

    typed=False leaves scalars as text (except null) so pydantic converts them to the field's own type:
    `trainer.experiment_name=007` stays "007".
    """
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in ("null", "none", "~"):
        return None
    if text.startswith("[") and text.endswith("]"):
        return [parse_value(part, typed=typed) for part in _split_top_level(text[1:-1])]
    if text.startswith("{") and text.endswith("}"):
        mapping = {}
        for part in _split_top_level(text[1:-1]):
            key, sep, value = part.partition(":")
            if not sep:
                raise ValueError(f"expected key: value inside {{...}}, got {part.strip()!r}")
            mapping[str(parse_value(key, typed=False))] = parse_value(value, typed=typed)
        return mapping
    if not typed:
        return text
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def _section_type(annotation: Any) -> type[Section] | None:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def _is_open_mapping(annotation: Any) -> bool:
    """dict-typed fields (override_config, engine_kwargs, ...) take any keys."""
    return typing.get_origin(annotation) is dict


def config_keys(model: type[Section] = Config, prefix: str = "") -> list[str]:
    """Every dotted key (sections and values) of the configuration tree."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = _section_type(field.annotation)
        if sub is not None:
            keys += config_keys(sub, f"{prefix}{name}.")
    return keys


def unknown_key_message(key: str) -> str:
    """`unknown key 'x'; did you mean 'y'?` naming the closest valid keys.

    Candidates are scored on the whole dotted path and on the last name alone (a key put in the wrong
    section); only those nearly as close as the best one are named.
    """
    leaf = key.rpartition(".")[2]

    def score(candidate: str) -> float:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, leaf, candidate.rpartition(".")[2]).ratio()
        return max(whole, last - 0.05)

    scored = sorted(((score(k), k) for k in config_keys()), reverse=True)
    best = scored[0][0]
    guesses = [k for s, k in scored[:3] if s >= max(0.75, best - 0.02)]
    if not guesses:
        return f"unknown key '{key}' (python -m trainer.config --markdown lists every key)"
    quoted = [f"'{g}'" for g in guesses]
    alternatives = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"unknown key '{key}'; did you mean {alternatives}?"


def _field_at(path: list[str]) -> tuple[Any, bool] | None:
    """(annotation, open_mapping) of the field at `path`, open_mapping when it is or lies inside a dict-typed
    field (whose values have no declared type); None when the path is not a key."""
    model: type[Section] | None = Config
    for part in path:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        if _is_open_mapping(field.annotation):
            return field.annotation, True
        model = _section_type(field.annotation)
    return field.annotation, False


def check_keys(tree: dict, model: type[Section] = Config, prefix: str = "") -> list[str]:
    """Unknown keys and values given where a section belongs, each with a fix.

    The offending entries are removed from `tree`, so the rest can still be validated and every
    problem reported in one go.
    """
    problems = []
    for key, value in list(tree.items()):
        path = f"{prefix}{key}"
        field = model.model_fields.get(key)
        sub = _section_type(field.annotation) if field is not None else None
        if field is None:
            problems.append(unknown_key_message(path))
            del tree[key]
        elif sub is not None and isinstance(value, dict):
            problems += check_keys(value, sub, f"{path}.")
        elif sub is not None:
            example = next(iter(sub.model_fields))
            problems.append(f"'{path}' is a section, not a value: set its keys, e.g. '{path}.{example}=...'")
            del tree[key]
    return problems


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[path[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _clean_yaml(node: Any) -> Any:
    """YAML files: drop verl's `_target_` keys; the text None means null, as on the command line."""
    if isinstance(node, dict):
        return {str(k): _clean_yaml(v) for k, v in node.items() if k != "_target_"}
    if isinstance(node, list):
        return [_clean_yaml(v) for v in node]
    return None if node == "None" else node


def read_yaml_config(path: str) -> dict:
    file = Path(path).expanduser()
    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"config file {path}: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path}: not valid YAML: {str(exc).splitlines()[0]}"]) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            [f"config file {path}: expected a mapping of keys at the top, got {type(loaded).__name__}"]
        )
    return _clean_yaml(loaded)


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*")


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(YAML files, [(key, raw value)]) from `--config F`, `--config=F`, `config=F` and `[+]key=value`
    items.
    """
    files, overrides, problems = [], [], []
    items = iter(argv)
    for item in items:
        if item == "--config":
            file = next(items, None)
            if file is None:
                problems.append("--config needs a file")
            else:
                files.append(file)
            continue
        key, sep, raw = item.partition("=")
        key = key.lstrip("+")
        if key in ("--config", "config") and sep:
            files.append(raw)
        elif not sep or not _KEY.fullmatch(key):
            hint = " (deleting keys with ~ is not supported)" if item.startswith("~") else ""
            problems.append(f"expected key=value, got {item!r}{hint}")
        else:
            overrides.append((key, raw))
    if problems:
        raise ConfigError(problems)
    return files, overrides


def _typed_references(tree: dict, defaults: dict) -> list[str]:
    """Resolve values that are exactly `${key}` for non-text fields, before pydantic types them."""
    problems = []

    def walk(node: dict, prefix: list[str]) -> None:
        for key, value in node.items():
            path = [*prefix, key]
            if isinstance(value, dict):
                walk(value, path)
            elif isinstance(value, str) and _REFERENCE.fullmatch(value.strip()):
                found = _field_at(path)
                if found is None or _unwrap_optional(found[0]) is str:
                    continue  # text fields are resolved after validation, against the final values
                try:
                    node[key] = interpolate(value.strip(), _merge(defaults, tree))
                except ValueError as exc:
                    problems.append(f"{'.'.join(path)}: {exc}")

    walk(tree, [])
    return problems


def _validation_messages(exc: ValidationError) -> list[str]:
    messages = []
    for error in exc.errors():
        # Drop pydantic's union-member tags ('list[str]', 'function-after[...]') from the location.
        parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in error["loc"] if "[" not in str(p)]
        where = ".".join(parts).replace(".[", "[")
        message = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        shown = "" if isinstance(given, (dict, BaseModel)) or not where else f" (got {given!r})"
        messages.append(f"{where}: {message}{shown}" if where else message)
    return messages


def load_config(argv: list[str], *, check: bool = True) -> Config:
    """Parse `key=value` overrides (after any YAML files) into a validated Config.

    Raises ConfigError listing every problem: unknown keys (with the closest valid ones), bad values,
    and with check=True the run checks (batch-size divisibility, missing paths, unsupported options).
    """
    files, overrides = split_argv(argv)
    tree: dict = {}
    for file in files:
        tree = _merge(tree, read_yaml_config(file))
    problems = []
    for key, raw in overrides:
        path = key.split(".")
        found = _field_at(path)
        typed = found is not None and found[1]  # an open mapping has no field type to convert to
        try:
            _set_path(tree, path, parse_value(raw, typed=typed))
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    problems += check_keys(tree)
    problems += _typed_references(tree, _defaults_tree())
    try:
        config = Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(problems + _validation_messages(exc)) from None
    if check:
        problems += config.problems()
    if problems:
        raise ConfigError(problems)
    return config


def _defaults_tree() -> dict:
    return Config().model_dump()


# ---------------------------------------------------------------------------------------- reference


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " / ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(field: Any, value: Any) -> str:
    extra = field.json_schema_extra or {}
    if "env" in extra:
        return f"`${extra['env']}`, else `{extra['fallback']}`"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return str(value)


def _reference_rows(section: Section, prefix: str) -> list[str]:
    rows = []
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, Section):
            rows += _reference_rows(value, f"{prefix}{name}.")
            continue
        description = (field.description or "").replace("|", "\\|")
        cells = [
            f"`{prefix}{name}`",
            type_name(field.annotation).replace("|", "\\|"),
            _default_text(field, value),
            description,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def config_reference_markdown() -> str:
    """The configuration reference (key, type, default, description), one table per top-level section."""
    # Built from a default Config made without running the fill-in validator, so "null: <rule>" defaults
    # show as null with their rule in the description.
    raw = Config.model_construct(
        **{name: field.get_default(call_default_factory=True) for name, field in Config.model_fields.items()}
    )
    lines = [
        "Every key of `python -m trainer.main_ppo key=value ...` (generated from `trainer/config.py`).",
        'Keys marked "ignored" are accepted so verl scripts run unchanged, and change nothing here.',
    ]
    for name, field in Config.model_fields.items():
        lines += [
            "",
            f"### {name}",
            "",
            field.description or "",
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        lines += _reference_rows(getattr(raw, name), f"{name}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--markdown"]:
        print(config_reference_markdown(), end="")
        return 0
    try:
        config = load_config(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    print(config.resolved_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
