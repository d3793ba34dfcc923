"""The typed schema: verl's `main_ppo` key tree as far as this trainer acts on it, every default here.

One pydantic model per verl section. Only keys that change what the trainer does are fields; verl keys
that change nothing here are accepted by name (trainer/config/accepted.py) and reported once at start.
A default written `null: <rule>` is filled in by trainer/config/derive.py when the config is built, so
the printed config is what runs. Torch-free: the CLI, the docs and the launcher tests import it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]
SECRET_KEYS = frozenset({"services.auth_token"})


class Section(BaseModel):
    # protected_namespaces=(): verl names keys `model_*`. Numbers given for text keys (an experiment
    # called 007 in YAML) become text, as OmegaConf's string nodes make them in verl.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), coerce_numbers_to_str=True)


def _one_or_many(value: Any) -> Any:
    """verl accepts one item where a list is expected (`trainer.logger=console`)."""
    return [value] if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------- data


class CustomClass(Section):
    path: str | None = Field(
        None, description="File defining a custom dataset class. Not supported: must stay null."
    )


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
        "(the data-server always shuffles, with its own --seed).",
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
    custom_cls: CustomClass = Field(
        default_factory=CustomClass, description="Custom dataset class (unsupported)."
    )

    _files = field_validator("train_files", "val_files", mode="before")(_one_or_many)


# ---------------------------------------------------------------------------------------- model / actor


class MixedPrecisionConfig(Section):
    """verl's `fsdp_config.mixed_precision` (on GPUs; fp32 throughout on the CPU)."""

    param_dtype: Literal["bf16", "bfloat16", "fp32", "float32"] = Field(
        "bf16",
        description="What FSDP gathers parameters in, computed under bf16 autocast either way. bf16 "
        "(verl's default): a bf16 copy of each layer, half the gather traffic. "
        "fp32: the fp32 shards themselves (slightly slower at 0.5B on one H100: actor MFU 31.6% against "
        "33.0%).",
    )
    reduce_dtype: Literal["fp32", "float32"] = Field(
        "fp32", description="Gradients are reduced across ranks in fp32 (the only choice here)."
    )
    buffer_dtype: Literal["fp32", "float32"] = Field(
        "fp32", description="Buffers (rotary frequencies) stay fp32 (the only choice here)."
    )

    @property
    def fp32_gathers(self) -> bool:
        return self.param_dtype in ("fp32", "float32")


class FSDPConfig(Section):
    """verl's `fsdp_config`: where a role's FSDP2 shards live (trainer/parallel/fsdp.py)."""

    param_offload: bool = Field(
        False, description="Move the parameter shards to the CPU between the role's calls."
    )
    optimizer_offload: bool = Field(False, description="Move the AdamW moments to the CPU between updates.")
    offload_policy: bool = Field(
        False, description="FSDP2 CPUOffloadPolicy: shards, gradients and the optimizer step stay on the CPU."
    )
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (false: keep them until backward)."
    )
    layers_per_unit: int = Field(
        1,
        ge=1,
        description="Consecutive decoder layers sharded as one FSDP2 unit: one all-gather and one "
        "reduce-scatter for them all (fewer, larger collectives and hooks; more memory gathered at once). "
        "Not verl's.",
    )
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)


class ModelConfig(Section):
    path: str = Field(
        "Qwen/Qwen2.5-0.5B-Instruct", description="Policy weights: a hub id, a local folder, or a .gguf file."
    )
    custom_chat_template: str | None = Field(
        None, description="Jinja chat template replacing the tokenizer's."
    )
    trust_remote_code: bool = Field(False, description="Allow the model repo's own Python code.")
    enable_gradient_checkpointing: bool = Field(
        True, description="Recompute activations in backward to save memory."
    )
    use_remove_padding: bool = Field(
        False,
        description="Pack each micro-batch's sequences into one row (no padding) for the policy, reference "
        "and critic forwards; variable-length flash attention on CUDA.",
    )
    share_prompts: bool = Field(
        False,
        description="With use_remove_padding: the samples of one prompt in a micro-batch (GRPO's n) share "
        "one pass of its tokens through the layers, each response attending to that prompt's keys and "
        "values; the same logprobs and gradients (to float rounding), fewer tokens (trainer/packing.py "
        "pack_shared). Not verl's.",
    )
    use_fused_kernels: bool = Field(
        True,
        description="Logprobs and entropy through the LM head in one chunked pass with a hand-written "
        "backward, never keeping fp32 [tokens x vocab] logits (trainer/workers/logprobs.py); false: the "
        "plain chunked path under activation checkpointing.",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank. Only 0 (full fine-tuning) is supported.")


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_warmup_steps: int | None = Field(
        -1, description="Linear warm-up steps; wins over the ratio. -1 or null: use lr_warmup_steps_ratio."
    )
    lr_warmup_steps_ratio: float = Field(
        0.0, ge=0, le=1, description="Warm-up steps as a fraction of all steps."
    )
    lr_scheduler_type: Literal["constant", "cosine"] = Field(
        "constant", description="Schedule after warm-up (cosine: one half cosine down to min_lr_ratio)."
    )
    warmup_style: Literal["constant", "cosine"] | None = Field(
        None, description="Older verl name of lr_scheduler_type; when set it wins."
    )
    min_lr_ratio: float | None = Field(
        0.0, ge=0, le=1, description="cosine: final lr as a fraction of lr (null: 0)."
    )
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    optimizer: Literal["AdamW"] = Field("AdamW", description="Optimizer class (only AdamW).")


CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]


def _has_model(contents: list[str] | None) -> list[str] | None:
    if contents is not None and "model" not in contents:
        raise ValueError("must include 'model' (the sharded weights every resume reads)")
    return contents


class CheckpointConfig(Section):
    """verl's `checkpoint` of a trained role: what each of its checkpoints holds, and what a resume reads."""

    save_contents: list[CheckpointContent] = Field(
        ["model", "optimizer", "extra"],
        description="What each checkpoint holds of this role: model (the sharded weights; required), "
        "optimizer (AdamW's moments, twice the weights' bytes), extra (the LR schedule), hf_model (the "
        "actor only: a transformers folder, loadable by from_pretrained, in its huggingface/). Without "
        "the optimizer a save writes a third of the bytes, and a resume restarts AdamW's moments.",
    )
    load_contents: list[CheckpointContent] | None = Field(
        None,
        description="What a resume reads back (hf_model is never read). null: save_contents. Asking for "
        "what the checkpoint does not hold stops the run with an error naming it.",
    )

    _lists = field_validator("save_contents", "load_contents", mode="before")(_one_or_many)
    _model = field_validator("save_contents", "load_contents")(_has_model)


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla"] = Field("vanilla", description="Policy loss: PPO clip (vanilla) only.")


class ActorConfig(Section):
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="The policy's FSDP2 shards.")
    ppo_mini_batch_size: int = Field(
        256,
        ge=1,
        description="Prompts per optimizer step; each step updates on this many prompts * rollout.n "
        "sequences. Need not divide data.train_batch_size: the last mini-batch is then smaller (as verl).",
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
    use_dynamic_bsz: bool = Field(
        False,
        description="Cut micro-batches by a token budget (ppo_max_token_len_per_gpu: whole consecutive "
        "sequences, prompt + response tokens; with model.share_prompts a group's prompt once, and cuts "
        "between groups) instead of ppo_micro_batch_size_per_gpu sequences: every forward equally full "
        "whatever the lengths. The loss is the same either way.",
    )
    ppo_max_token_len_per_gpu: int = Field(
        16384, ge=1, description="Tokens per micro-batch with use_dynamic_bsz (a longer sequence goes alone)."
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch of rollouts.")
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
    entropy_coeff: float = Field(
        0.0,
        description="Weight of the entropy bonus (subtracted from the loss). 0: entropy is still logged, "
        "but computed without gradients.",
    )
    use_torch_compile: bool = Field(
        True,
        description="GPU runs: compile each decoder layer and the logprob chunk with torch.compile (the "
        "attention call stays eager); a layer that fails to compile runs eagerly. CPU runs stay eager.",
    )
    use_kl_loss: bool = Field(False, description="Add KL(policy || reference) to the loss (GRPO style).")
    skip_zero_advantage_rows: bool = Field(
        True,
        description="Not verl's. When the loss is the policy term alone (no KL loss, entropy_coeff 0), "
        "the update skips the forward and backward of rows whose advantages are all 0 (a GRPO group "
        "whose rewards are all equal): their gradient is exactly 0, and the loss keeps its denominators, "
        "so the update is the same; pg_clipfrac, ppo_kl and entropy are then over the trained rows.",
    )
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss.")
    kl_loss_type: KLType = Field(
        "low_var_kl", description="KL estimator of the loss: kl/k1, abs, mse/k2, low_var_kl/k3."
    )
    policy_loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig, description="Policy loss variant."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="What the policy's checkpoints hold."
    )


# ---------------------------------------------------------------------------------------- rollout / ref


class ValKwargs(Section):
    temperature: float = Field(0.0, ge=0, description="Validation sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Validation nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Validation top-k (-1 or 0: off).")
    n: int = Field(1, ge=1, description="Responses per validation prompt.")
    do_sample: bool = Field(False, description="Sample during validation; false: greedy.")


class MultiTurnConfig(Section):
    enable: bool = Field(
        False,
        description="Multi-turn rollouts that call tools while they generate: the search tool (the "
        "retrieval-server) and the code interpreter (the code-executor), through trainer/agent/ on the "
        "run's engine (builtin for hf; sglang servers as they are).",
    )
    format: Literal["hermes", "search_r1"] = Field(
        "hermes",
        description="Tool-call format. hermes: <tool_call> JSON to any of the run's tools, their schemas "
        "shown by the chat template; search_r1: Search-R1's <search> / <information> / <answer> tags "
        "(the search tool alone).",
    )
    tool_config_path: str | None = Field(
        None,
        description="verl tool config YAML: a list of tools, verl.tools.search_tool.SearchTool "
        "(retrieval_service_url, topk, timeout) and/or verl.tools.sandbox_fusion_tools.SandboxFusionTool "
        "(sandbox_fusion_url: the code-executor, default_timeout, default_language, memory_limit_mb), "
        "each with config.type native and an optional tool_schema. null: the search tool alone at "
        "services.retrieval_url, topk 3, the SearchTool schema.",
    )
    tool_failure: Literal["text", "drop_group", "retry"] = Field(
        "text",
        description="What a failed tool call does (its service down after the client's retries, a "
        "sandbox error; not a program that raised). text: the failure text is the tool response and "
        "the trajectory goes on (verl's behaviour); drop_group: the prompt's whole group is left out "
        "of the step unscored (tool/dropped_groups counts them) and more prompts are generated to fill "
        "the batch, as DAPO's dynamic sampling does; a round in which every group fails stops the run; "
        "retry: the call runs again up to tool_failure_retries times, then as text. Under text and "
        "retry a round in which every tool call failed stops the run (the finished steps are saved).",
    )
    tool_failure_retries: int = Field(
        2, ge=1, description="tool_failure=retry: tries of a failed call after the first, with backoff."
    )
    max_assistant_turns: int | None = Field(
        None, ge=1, description="Model turns per trajectory. null: only the response length limits them."
    )
    max_user_turns: int | None = Field(
        None, ge=1, description="Tool turns per trajectory. null: only the response length limits them."
    )
    max_parallel_calls: int = Field(1, ge=1, description="Tool calls run per model turn (more are ignored).")
    max_tool_response_length: int = Field(
        256, ge=1, description="Tokens of one tool response kept (verl counts characters)."
    )
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle",
        description="What truncation keeps, as verl: left the start, right the end, middle both ends.",
    )


class RolloutConfig(Section):
    name: Literal["auto", "hf", "builtin", "sglang", "vllm"] = Field(
        "auto",
        description="Generation engine asked for. auto: builtin (on the CPU too), or hf for a model builtin "
        "cannot run (another architecture, a scaled RoPE; said in a warning). hf: transformers "
        "generate; builtin: the built-in fast engine (continuous batching; Triton kernels and CUDA graphs on "
        "GPU). Both run on every policy rank on their own copy of the weights (bf16 on GPU), synced after "
        "each update; sglang: SGLang servers at ROLLOUT_SERVER_URLS, else one started per GPU; vllm: not "
        "wired in yet, auto's engine generates instead (said at start).",
    )
    engine: str | None = Field(
        None,
        description="Set when the config is built: the engine that actually generates. Do not set.",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 or 0: off).")
    do_sample: bool = Field(True, description="Sample; false: greedy decoding.")
    n: int = Field(1, ge=1, description="Responses per prompt (the group size of GRPO/RLOO; > 1 for them).")
    prompt_length: int | None = Field(
        None, ge=1, description="Longest prompt for the engine. null: data.max_prompt_length."
    )
    response_length: int | None = Field(
        None,
        ge=1,
        description="Most tokens generated per response (a multi-turn trajectory's model and tool "
        "tokens), as in verl. null: data.max_response_length.",
    )
    stop: list[str] = Field(default_factory=list, description="Strings that end a response (kept in it).")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a response, besides EOS."
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="builtin on a GPU: the engine's weights and KV cache take at most this share of the "
        "GPU's memory (and no more than is free when it generates); the KV cache exists only while it "
        "generates. sglang servers started here: their --mem-fraction-static.",
    )
    free_cache_engine: bool = Field(
        True,
        description="Colocated engines: free the KV cache (and the built-in engine's CUDA graphs) after "
        "each rollout phase, so the log-prob and update passes have that memory. false: keep them between "
        "steps (no re-allocation or graph capture a step; the update gets less memory).",
    )
    tensor_model_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs per SGLang server (rollout.name=sglang: one started per group of this many GPUs); "
        "must divide the GPU count (as verl checks). The built-in engine holds a whole model per GPU.",
    )
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward when recomputing old logprobs. null: actor's micro-batch.",
    )
    log_prob_micro_batch_size: int | None = Field(
        None, ge=1, description="Deprecated global form of log_prob_micro_batch_size_per_gpu."
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        None,
        description="Cut old-logprob forwards by a token budget instead of a sequence count. "
        "null: the actor's use_dynamic_bsz.",
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Tokens per old-logprob forward with log_prob_use_dynamic_bsz. "
        "null: the actor's ppo_max_token_len_per_gpu.",
    )
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="Sampling used for validation.")
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="Multi-turn rollouts with tools (search, code)."
    )


class RefConfig(Section):
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="The reference's FSDP2 shards.")
    use_torch_compile: bool = Field(
        True, description="GPU runs: compile the reference's decoder layers (as the actor's key)."
    )
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="Sequences per reference forward. null: the actor's micro-batch."
    )
    log_prob_micro_batch_size: int | None = Field(
        None, ge=1, description="Deprecated global form of log_prob_micro_batch_size_per_gpu."
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        None,
        description="Cut reference forwards by a token budget instead of a sequence count. "
        "null: the actor's use_dynamic_bsz.",
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Tokens per reference forward with log_prob_use_dynamic_bsz. "
        "null: the actor's ppo_max_token_len_per_gpu.",
    )


class ActorRolloutRefConfig(Section):
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The policy model (also the reference)."
    )
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy training.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    ref: RefConfig = Field(default_factory=RefConfig, description="Frozen reference policy for the KL terms.")


# ---------------------------------------------------------------------------------------- critic / reward


class CriticModelConfig(Section):
    path: str | None = Field(
        None, description="Critic weights (a value head is added). null: the policy model's path."
    )
    trust_remote_code: bool | None = Field(
        None, description="null: actor_rollout_ref.model.trust_remote_code."
    )
    enable_gradient_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    use_remove_padding: bool | None = Field(
        None, description="Padding-free critic forwards. null: actor_rollout_ref.model.use_remove_padding."
    )
    share_prompts: bool | None = Field(
        None, description="Shared prompt passes (packed only). null: actor_rollout_ref.model.share_prompts."
    )
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig, description="The critic's FSDP2 shards.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank. Only 0 is supported.")


class CriticConfig(Section):
    enable: bool | None = Field(
        None, description="Train a critic. null: only when algorithm.adv_estimator=gae."
    )
    model: CriticModelConfig = Field(default_factory=CriticModelConfig, description="The value model.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description="Critic optimizer.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="What the critic's checkpoints hold."
    )
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
    use_dynamic_bsz: bool | None = Field(
        None, description="Token-budget micro-batches for the critic (as the actor's key). null: the actor's."
    )
    ppo_max_token_len_per_gpu: int = Field(
        32768, ge=1, description="Tokens per critic micro-batch with use_dynamic_bsz."
    )
    forward_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Tokens per value forward with use_dynamic_bsz. null: ppo_max_token_len_per_gpu.",
    )
    ppo_epochs: int | None = Field(
        None, ge=1, description="Critic passes per batch. null: the actor's ppo_epochs."
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's gradient norm.")
    cliprange_value: float = Field(
        0.5, gt=0, description="Value clipping: new values stay within old +- this."
    )
    loss_agg_mode: LossAggMode | None = Field(None, description="Value loss aggregation. null: the actor's.")


class OverlongBuffer(Section):
    enable: bool = Field(False, description="DAPO overlong penalty on responses near the length limit.")
    len: int = Field(
        0, ge=0, description="Buffer before max_response_length where the penalty grows linearly."
    )
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at the length limit.")


class SandboxFusionConfig(Section):
    url: str | None = Field(
        None,
        description="verl's sandbox_fusion.url: the code-executor's /run_code URL (or several, "
        "comma-separated); reward_model.mode=local runs code rows' tests there.",
    )


class RewardModelConfig(Section):
    mode: Literal["auto", "server", "local"] = Field(
        "auto",
        description="server: score through the reward-server; local: the same scorers in-process (verl's "
        "default). auto: server when a reward-server is configured (services.reward_url or "
        "$REWARD_SERVER_URL), else local.",
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
    sandbox_fusion: SandboxFusionConfig = Field(
        default_factory=SandboxFusionConfig, description="Where code rows run their tests (verl's keys)."
    )
    max_error_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Stop the run when the share of a generation round's rewards that could not be computed "
        "(no scorer for the data_source, a scorer that failed or timed out: scored 0 with an error) reaches "
        "this fraction; logged as reward/error_fraction. 1.0: only when every reward is an error; 0.0: "
        "at the first error.",
    )


class CustomRewardFunction(Section):
    path: str | None = Field(
        None,
        description="Python file with a verl-style compute_score(data_source, solution_str, ground_truth, "
        "extra_info); used by reward_model.mode=local instead of the built-in scorers.",
    )
    name: str | None = Field(
        "compute_score",
        description="Function name in that file (null, as verl's old default: compute_score).",
    )


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
