"""Startup checks: what stops a run before any work starts, and what it should say once at start.

The rule: refuse what verl refuses (its validate_config, its workers' asserts) and what cannot work here;
accept the rest, as verl does. `problems` returns one line per problem, each naming the keys involved;
`notices` returns the lines printed once at start (an engine substituted, verl keys with no effect).
"""

from __future__ import annotations

from pathlib import Path

from trainer.config.derive import slow_bf16
from trainer.config.run import Config

GPUS = "trainer.nnodes * trainer.n_gpus_per_node"


def problems(config: Config) -> list[str]:
    found = [
        *ray_problems(config),
        *batch_size_problems(config),
        *path_problems(config),
        *packing_problems(config),
        *algorithm_problems(config),
        *multi_turn_problems(config),
        *checkpoint_problems(config),
    ]
    return [p for p in found if p]


def checkpoint_problems(config: Config) -> list[str]:
    """hf_model writes the policy's transformers folder; a critic's value head has none to write."""
    if config.use_critic and "hf_model" in config.critic.checkpoint.save_contents:
        return [
            "critic.checkpoint.save_contents: hf_model is written for the actor only (a value model "
            "has no transformers causal-LM folder); leave it out"
        ]
    return []


def ray_problems(config: Config) -> list[str]:
    """More than one GPU (or trainer.use_ray=true) trains through Ray role groups: Ray must be installed,
    and use_ray=false cannot ask for more than one GPU."""
    import importlib.util

    if config.trainer.use_ray is False and config.world_size > 1:
        return [
            f"trainer.use_ray=false trains in this one process on one device, but {GPUS} = "
            f"{config.world_size} GPUs: leave use_ray unset (or true) to train on all of them through Ray"
        ]
    if not config.uses_ray or importlib.util.find_spec("ray") is not None:
        return []
    return [
        f"{GPUS} = {config.world_size} GPUs (or trainer.use_ray=true) trains through Ray, which is not "
        "installed: pip install 'ray[default]' (part of the trainer extra)"
    ]


def notices(config: Config) -> list[str]:
    lines = []
    rollout = config.actor_rollout_ref.rollout
    if rollout.multi_turn.enable and rollout.name not in (rollout.engine, "auto"):
        lines.append(
            f"rollout: multi-turn tool calls run on the {rollout.engine} engine (it batches turns "
            f"continuously as they arrive), not on actor_rollout_ref.rollout.name={rollout.name}"
        )
    elif rollout.name == "vllm":
        lines.append(
            f"rollout: actor_rollout_ref.rollout.name={rollout.name} is not wired in yet; the built-in "
            "engine (continuous batching, on each policy rank) generates instead"
        )
    if rollout.engine == "sglang" and config.trainer.nnodes > 1:
        lines.append(
            "rollout: SGLang servers are started on this node's GPUs only (the other nodes' ranks do not "
            "generate) unless ROLLOUT_SERVER_URLS names servers on every node; the built-in engine runs on "
            "every policy rank of every node"
        )
    if rollout.tensor_model_parallel_size > 1 and rollout.engine != "sglang":
        lines.append(
            f"rollout: tensor_model_parallel_size={rollout.tensor_model_parallel_size} applies to SGLang "
            f"servers; the {rollout.engine} engine holds the whole model on each policy rank's GPU"
        )
    filter_groups = config.algorithm.filter_groups
    if (
        filter_groups.enable
        and filter_groups.metric == "seq_final_reward"
        and config.algorithm.use_kl_in_reward
    ):
        lines.append(
            "algorithm.filter_groups: groups are kept or dropped before the KL-in-reward penalty exists (it "
            "needs the kept batch's reference logprobs), so metric=seq_final_reward reads the scores, as "
            "seq_reward does"
        )
    if rollout.n > 1 and not rollout.do_sample:
        lines.append("rollout: n > 1 with do_sample=false gives n identical responses per prompt")
    if config.no_effect_keys:
        lines.append("accepted, no effect here: " + ", ".join(config.no_effect_keys))
    if slow_bf16(config):
        lines.append(
            "trainer.mixed_precision=bf16: this CPU has no bf16 matmul hardware (AVX512-BF16 or AMX), where "
            "torch's bf16 matmuls run ~70x slower than fp32: the run computes in fp32"
        )
    sections = {"actor_rollout_ref.actor": config.actor_rollout_ref.actor, "critic": config.critic}
    for key, section in sections.items():
        if (key == "actor_rollout_ref.actor" or config.use_critic) and "optimizer" not in (
            section.checkpoint.load_contents or section.checkpoint.save_contents
        ):
            lines.append(
                f"checkpoint: {key}.checkpoint leaves out the optimizer: a resume restarts AdamW's moments"
            )
    if config.reward_model.sandbox_fusion.url and config.reward_model.mode == "server":
        lines.append(
            "reward: reward_model.sandbox_fusion.url has no effect with reward_model.mode=server: the "
            "reward-server runs code rows on its own --code-executor-url"
        )
    elif config.reward_model.sandbox_fusion.url and config.custom_reward_function.path:
        lines.append(
            "reward: reward_model.sandbox_fusion.url has no effect: custom_reward_function.path scores "
            "every row"
        )
    lines += tool_config_notices(config)
    return lines


# ---------------------------------------------------------------------------------------- batch sizes


def mini_batch_problems(
    prefix: str, mini: int, micro_per_gpu: int | None, micro_global: int | None, config: Config
) -> list[str]:
    """verl's checks of one trained model's mini/micro batch sizes (actor or critic).

    verl does not require ppo_mini_batch_size to divide data.train_batch_size (the last mini-batch is
    smaller), nor the sequences to split evenly over the GPUs (each GPU takes the floor).
    """
    batch, n, world = config.data.train_batch_size, config.actor_rollout_ref.rollout.n, config.world_size
    per_gpu = mini * n // world
    if mini > batch:
        return [f"{prefix}.ppo_mini_batch_size ({mini}) is larger than data.train_batch_size ({batch})"]
    if per_gpu == 0:
        return [
            f"{prefix}.ppo_mini_batch_size * actor_rollout_ref.rollout.n = {mini * n} sequences is fewer "
            f"than the {world} GPU(s) ({GPUS})"
        ]
    if micro_global is not None and micro_global < world:
        return [
            f"{prefix}.ppo_micro_batch_size ({micro_global}, deprecated, global) is fewer than {world} GPUs"
        ]
    if micro_per_gpu is not None and per_gpu % micro_per_gpu:
        return [
            f"{prefix}.ppo_mini_batch_size * actor_rollout_ref.rollout.n / GPUs = {per_gpu} sequences per "
            f"GPU must be divisible by {prefix}.ppo_micro_batch_size_per_gpu ({micro_per_gpu})"
        ]
    return []


def batch_size_problems(config: Config) -> list[str]:
    arr, data = config.actor_rollout_ref, config.data
    actor, rollout, n, world = arr.actor, arr.rollout, arr.rollout.n, config.world_size
    found = []
    if (data.train_batch_size * n) % world:
        found.append(
            f"data.train_batch_size * actor_rollout_ref.rollout.n = {data.train_batch_size * n} responses "
            f"per step must split evenly over {world} GPU(s) ({GPUS})"
        )
    found += mini_batch_problems(
        "actor_rollout_ref.actor",
        actor.ppo_mini_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        actor.ppo_micro_batch_size,
        config,
    )
    if config.use_critic:
        found += critic_batch_problems(config, reported=found)
    if rollout.prompt_length is not None and rollout.prompt_length < config.data.max_prompt_length:
        found.append(
            f"actor_rollout_ref.rollout.prompt_length ({rollout.prompt_length}) is less than "
            f"data.max_prompt_length ({config.data.max_prompt_length}): the engine's context would not hold "
            "the longest prompts (leave it unset to follow data.max_prompt_length)"
        )
    if world % rollout.tensor_model_parallel_size:
        found.append(
            "actor_rollout_ref.rollout.tensor_model_parallel_size "
            f"({rollout.tensor_model_parallel_size}) must divide the {world} GPU(s) ({GPUS})"
        )
    return found


def critic_batch_problems(config: Config, reported: list[str]) -> list[str]:
    """The critic's mini/micro batch problems, said once: a size the critic inherited from the actor
    (verl's default) is the actor's key to fix, already reported; and since a critic trains only with
    algorithm.adv_estimator=gae (verl's default estimator) unless critic.enable asks for one, a run meant
    as GRPO learns why it has a critic at all."""
    critic = config.critic
    found = [
        problem
        for problem in mini_batch_problems(
            "critic",
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
            critic.ppo_micro_batch_size,
            config,
        )
        if problem.replace("critic.", "actor_rollout_ref.actor.") not in reported
    ]
    if config.algorithm.adv_estimator == "gae":
        why = (
            " (a critic trains because algorithm.adv_estimator=gae, the default; "
            "GRPO: algorithm.adv_estimator=grpo)"
        )
        found = [problem + why for problem in found]
    return found


# ---------------------------------------------------------------------------------------- paths


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
    looks_local = path.startswith(("/", "./", "../", "~")) or path in (".", "..")
    if path and hub_shaped and not looks_local:
        return None
    return (
        f"{key}: {path} does not exist (give a local folder, a .gguf file or a hub id like "
        "Qwen/Qwen2.5-0.5B-Instruct)"
    )


def _file_problems(key: str, files: list[str] | None) -> list[str]:
    found = []
    for file in files or []:
        path = Path(file).expanduser()
        if not path.is_file():
            found.append(f"{key}: {file} does not exist")
        elif path.suffix not in (".parquet", ".jsonl", ".json"):
            found.append(f"{key}: {file} is not a .parquet or .jsonl file")
    return found


def _data_problems(config: Config) -> list[str]:
    data = config.data
    if data.source == "files":
        missing = [] if data.train_files else ["data.source=files needs data.train_files"]
        return (
            missing
            + _file_problems("data.train_files", data.train_files)
            + _file_problems("data.val_files", data.val_files)
        )
    found = [
        f"data.{key} is set but data.source=server reads from the data-server"
        for key in ("train_files", "val_files")
        if getattr(data, key)
    ]
    if not config.services.data_url:
        found.append("data.source=server needs services.data_url (or env DATA_SERVER_URL)")
    return found


def path_problems(config: Config) -> list[str | None]:
    arr, trainer = config.actor_rollout_ref, config.trainer
    found: list[str | None] = _data_problems(config)
    if config.reward_model.mode == "server" and not config.services.reward_url:
        found.append("reward_model.mode=server needs services.reward_url (or env REWARD_SERVER_URL)")
    found.append(model_path_problem("actor_rollout_ref.model.path", arr.model.path))
    if config.data.tokenizer:
        found.append(model_path_problem("data.tokenizer", config.data.tokenizer))
    if config.use_critic and config.critic.model.path != arr.model.path:
        found.append(model_path_problem("critic.model.path", config.critic.model.path or ""))
    reward_file = config.custom_reward_function.path
    if reward_file and not Path(reward_file).expanduser().is_file():
        found.append(f"custom_reward_function.path: {reward_file} does not exist")
    if trainer.resume_mode == "resume_path":
        if not trainer.resume_from_path:
            found.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        elif not Path(trainer.resume_from_path).expanduser().is_dir():
            found.append(f"trainer.resume_from_path: {trainer.resume_from_path} is not a folder")
    return found


# ---------------------------------------------------------------------------------------- packing


def packing_problems(config: Config) -> list[str]:
    """Shared prompts without packing (a shared prompt is a packed layout), for the actor's model and a
    critic's whose settings differ (else the critic's are the actor's: one line says it)."""
    arr, critic = config.actor_rollout_ref, config.critic.model
    models = [("actor_rollout_ref.model", arr.model)]
    if config.use_critic and (critic.share_prompts, critic.use_remove_padding) != (
        arr.model.share_prompts,
        arr.model.use_remove_padding,
    ):
        models.append(("critic.model", critic))
    return [
        f"{key}.share_prompts needs {key}.use_remove_padding=true (a shared prompt is a packed layout; a "
        "padded batch has a row per sample)"
        for key, model in models
        if model.share_prompts and not model.use_remove_padding
    ]


# ---------------------------------------------------------------------------------------- algorithm


def algorithm_problems(config: Config) -> list[str]:
    """What cannot work: a critic-less GAE, a group of one to filter, an adaptive KL aimed at 0, ..."""
    arr, algo, data = config.actor_rollout_ref, config.algorithm, config.data
    found = []
    if algo.adv_estimator == "gae" and not config.use_critic:
        found.append("algorithm.adv_estimator=gae needs a critic, but critic.enable=false")
    if algo.filter_groups.enable and arr.rollout.n < 2:
        found.append(
            "algorithm.filter_groups.enable needs actor_rollout_ref.rollout.n >= 2 (a group of one never "
            "varies)"
        )
    if arr.rollout.val_kwargs.do_sample and arr.rollout.temperature <= 0:
        found.append(  # verl's own check, on the same (training) temperature
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true needs "
            "actor_rollout_ref.rollout.temperature > 0"
        )
    if algo.kl_ctrl.type == "adaptive" and algo.kl_ctrl.target_kl <= 0:
        found.append("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0")
    buffer = config.reward_model.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= data.max_response_length:
        found.append(
            f"reward_model.overlong_buffer.len ({buffer.len}) must be in 1..data.max_response_length "
            f"({data.max_response_length})"
        )
    unsupported = {
        "actor_rollout_ref.model.lora_rank": arr.model.lora_rank != 0,
        "critic.model.lora_rank": config.critic.model.lora_rank != 0,
        "data.custom_cls.path": data.custom_cls.path is not None,
    }
    found += [
        f"{key}: not supported by this trainer (leave it at its default)"
        for key, bad in unsupported.items()
        if bad
    ]
    return found


# ---------------------------------------------------------------------------------------- multi-turn


def tool_config_notices(config: Config) -> list[str]:
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return []
    lines = []
    retries_default = type(multi_turn).model_fields["tool_failure_retries"].default
    if multi_turn.tool_failure != "retry" and multi_turn.tool_failure_retries != retries_default:
        lines.append(
            f"no effect: actor_rollout_ref.rollout.multi_turn.tool_failure_retries="
            f"{multi_turn.tool_failure_retries} (tool_failure={multi_turn.tool_failure}, not retry)"
        )
    if not multi_turn.tool_config_path:
        return lines
    from trainer.agent.tools import load_tool_config

    try:
        tools = load_tool_config(multi_turn.tool_config_path)
    except ValueError:
        return lines  # a problem, reported by multi_turn_problems
    if tools.no_effect:
        lines.append(
            f"accepted, no effect here: {', '.join(tools.no_effect)} of {multi_turn.tool_config_path} (the "
            "loop batches searches and runs calls concurrently itself)"
        )
    return lines


def multi_turn_problems(config: Config) -> list[str]:
    """The tools must be reachable by name: a readable tool config, or a retrieval-server URL for search;
    Search-R1's tags call the search tool alone."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return []
    key = "actor_rollout_ref.rollout.multi_turn"
    if multi_turn.tool_config_path:
        from trainer.agent.tools import load_tool_config  # torch-free

        try:
            tools = load_tool_config(multi_turn.tool_config_path)
        except ValueError as exc:
            return [f"{key}.tool_config_path: {exc}"]
        if multi_turn.format == "search_r1" and (len(tools.tools) != 1 or tools.search is None):
            return [
                f"{key}.format=search_r1 calls the search tool alone, but {multi_turn.tool_config_path} "
                f"lists {list(tools.names)}; use format=hermes for several tools"
            ]
        return []
    if not config.services.retrieval_url:
        return [
            f"{key}.enable needs {key}.tool_config_path or services.retrieval_url (env RETRIEVAL_SERVER_URL)"
        ]
    return []
