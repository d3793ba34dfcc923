"""verl keys this trainer accepts so verl scripts run unchanged, but which change nothing here.

They are not schema fields (no type, no default): load_config takes them out of the user's tree and the
run prints them once at start ("accepted, no effect here: ..."). An entry covers its whole subtree
(`actor_rollout_ref.actor.fsdp_config` covers `.param_offload`, `.wrap_policy.min_num_params`, ...).
Any other key is an error that names the closest valid one.

When a key starts to do something, delete it here and add it, typed and documented, to the schema.
"""

from __future__ import annotations

_REF_AND_ACTOR = """
    ulysses_sequence_parallel_size entropy_from_logits_with_chunking entropy_checkpointing
    profiler router_replay rollout_n strategy qat
"""
# fsdp_config keys of verl's FSDP (1 and 2) that change nothing here: one unit per decoder layer and fp32
# master weights are fixed (trainer/parallel/fsdp.py)
_FSDP = """
    wrap_policy fsdp_size forward_prefetch model_dtype use_orig_params grad_offload dtype
    strategy seed full_determinism entropy_from_logits_with_chunking entropy_checkpointing forward_only
    ulysses_sequence_parallel_size use_torch_compile qat
"""


def _under(prefix: str, names: str) -> list[str]:
    return [f"{prefix}.{name}" for name in names.split()]


NO_EFFECT_KEYS: frozenset[str] = frozenset(
    [
        # data: loading knobs of verl's dataset class; prompts are read in-process, text only
        *_under(
            "data",
            """
            return_raw_chat return_raw_input_ids return_full_prompt validation_shuffle use_shm
            dataloader_num_workers filter_overlong_prompts_workers image_key video_key image_patch_size
            return_multi_modal_inputs train_max_samples val_max_samples tool_config_path sampler datagen
            custom_cls.name
            """,
        ),
        # the policy model: kernels, padding-free passes, LoRA details, HF config overrides
        *_under(
            "actor_rollout_ref.model",
            """
            external_lib use_shm enable_activation_offload use_liger
            fused_kernel_options lora_alpha target_modules exclude_modules lora_adapter_path override_config
            hf_config_path tokenizer_path tiled_mlp mtp
            """,
        ),
        # the actor: FSDP and sequence parallelism knobs
        *_under("actor_rollout_ref.actor", _REF_AND_ACTOR),
        *_under("actor_rollout_ref.actor.fsdp_config", _FSDP),
        *_under("actor_rollout_ref.ref.fsdp_config", _FSDP),
        *_under("critic.model.fsdp_config", _FSDP),
        *_under(
            "actor_rollout_ref.actor",
            """
            shuffle use_remove_padding use_fused_kernels checkpoint.async_save checkpoint.mbridge_config
            tau_pos tau_neg freeze_vision_tower calculate_entropy use_prefix_grouper data_loader_seed
            calculate_sum_pi_squared sum_pi_squared_checkpointing optim.total_training_steps optim.clip_grad
            optim.num_cycles optim.optimizer_impl optim.override_optimizer_config optim.zero_indexed_step
            policy_loss.clip_cov_ratio
            policy_loss.clip_cov_lb policy_loss.clip_cov_ub policy_loss.kl_cov_ratio policy_loss.ppo_kl_coef
            """,
        ),
        *_under("actor_rollout_ref.ref", _REF_AND_ACTOR),
        # rollout: knobs of external engines (vLLM / SGLang), which are not wired in yet
        *_under(
            "actor_rollout_ref.rollout",
            """
            mode dtype enforce_eager
            load_format max_num_batched_tokens max_model_len max_num_seqs enable_chunked_prefill
            disable_log_stats calculate_log_probs layered_summon update_weights_bucket_megabytes
            over_sample_rate multi_stage_wake_up ignore_eos engine_kwargs
            cudagraph_capture_sizes data_parallel_size expert_parallel_size pipeline_model_parallel_size
            enable_prefix_caching logprobs_mode scheduling_policy agent checkpoint_engine trace skip_rollout
            skip_dump_dir skip_tokenizer_init enable_rollout_routing_replay profiler prometheus quantization
            quantization_config_file mtp qat nnodes n_gpus_per_node
            """,
        ),
        # multi-turn: user simulators and verl's re-tokenisation checks (the agent loop never re-tokenises)
        *_under(
            "actor_rollout_ref.rollout.multi_turn",
            """
            max_turns interaction_config_path use_inference_chat_template tokenization_sanity_check_mode
            num_repeat_rollouts
            """,
        ),
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.nccl_timeout",
        # critic: the same FSDP knobs as the actor
        *_under(
            "critic",
            """
            shuffle strategy rollout_n checkpoint.async_save checkpoint.mbridge_config
            ulysses_sequence_parallel_size
            data_loader_seed profiler
            optim.total_training_steps optim.clip_grad optim.num_cycles optim.optimizer_impl
            optim.override_optimizer_config optim.zero_indexed_step
            """,
        ),
        *_under(
            "critic.model",
            """
            external_lib enable_activation_offload use_shm lora_alpha
            target_modules override_config tokenizer_path tiled_mlp
            """,
        ),
        # reward_model: verl's reward-model worker and reward managers; scoring is batched here
        *_under(
            "reward_model",
            """
            enable reward_manager launch_reward_fn_async strategy model micro_batch_size
            micro_batch_size_per_gpu max_length use_dynamic_bsz forward_max_token_len_per_gpu
            ulysses_sequence_parallel_size enable_resource_pool n_gpus_per_node nnodes reward_loop_source
            reward_loop_module_path reward_loop_class_name profiler use_reward_loop
            num_workers rollout reward_kwargs overlong_buffer.log
            """,
        ),
        # the code-executor bounds its own runs (its --workers); each test case asks for 1024 MiB, verl's
        # default memory_limit_mb (services.scoring's code_memory_mb)
        *_under("reward_model.sandbox_fusion", "max_concurrent memory_limit_mb"),
        *_under("algorithm", "use_pf_ppo pf_ppo rollout_correction"),
        # trainer: Ray, HDFS and multi-rank details
        *_under(
            "trainer",
            """
            default_hdfs_dir del_local_ckpt_after_load esi_redundant_time
            ray_wait_register_center_timeout use_legacy_worker_impl max_critic_ckpt_to_keep
            validation_data_dir device_name
            """,
        ),
        "reward_manager",
        "global_profiler",
        "transfer_queue",
        "ray_kwargs",
        "ray_init",
    ]
)


def is_no_effect(path: str) -> bool:
    """True when the dotted key, or a section above it, is in NO_EFFECT_KEYS."""
    parts = path.split(".")
    return any(".".join(parts[: i + 1]) in NO_EFFECT_KEYS for i in range(len(parts)))


def pop_no_effect(tree: dict, prefix: str = "") -> list[str]:
    """Remove the no-effect keys from a user's nested tree in place; their dotted paths, leaves first."""
    found = []
    for key in list(tree):
        path = f"{prefix}{key}"
        if is_no_effect(path):
            found += _leaves(tree.pop(key), path)
        elif isinstance(tree[key], dict):
            found += pop_no_effect(tree[key], f"{path}.")
    return found


def _leaves(value, path: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for key, child in value.items() for leaf in _leaves(child, f"{path}.{key}")]
    return [path]
