"""trainer.config / trainer.main_ppo: verl's commands parse as written, bad input is refused with a clear
line.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

from services.data_server.export import write_verl_parquet
from services.data_server.sources import gsm8k_row
from tests.helpers import ROOT
from trainer.config import (
    Config,
    ConfigError,
    checks,
    config_keys,
    config_reference_markdown,
    load_config,
)

# verl docs/start/quickstart.rst, "Quickstart: PPO training on GSM8K dataset" (PPO with a critic), verbatim.
PPO_QUICKSTART = r"""
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
 data.train_files=$HOME/data/gsm8k/train.parquet \
 data.val_files=$HOME/data/gsm8k/test.parquet \
 data.train_batch_size=256 \
 data.max_prompt_length=512 \
 data.max_response_length=512 \
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.actor.optim.lr=1e-6 \
 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
 actor_rollout_ref.rollout.name=vllm \
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
 critic.optim.lr=1e-5 \
 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 critic.ppo_micro_batch_size_per_gpu=4 \
 algorithm.kl_ctrl.kl_coef=0.001 \
 trainer.logger=console \
 trainer.val_before_train=False \
 trainer.n_gpus_per_node=1 \
 trainer.nnodes=1 \
 trainer.save_freq=10 \
 trainer.test_freq=10 \
 trainer.total_epochs=15 2>&1 | tee verl_demo.log
"""

# verl examples/grpo_trainer/run_qwen3-8b.sh (GRPO, KL loss, no critic), verbatim.
GRPO_QWEN3 = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen3-8B \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen3_8b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

# verl's GSM8K GRPO quickstart for Qwen3 (the Qwen3 page of verl's docs), verbatim: 1024 prompts per
# step in mini-batches of 80, which verl accepts (the 13th mini-batch has 64 prompts).
QWEN3_QUICKSTART = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen3-1.7B \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=80 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=3 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console'] \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen3_1_7b_function_rm' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

# The same two commands with a small local model and sizes for one CPU/GPU; nothing else changed.
SMALL = {
    PPO_QUICKSTART: {
        "data.train_batch_size=256": "data.train_batch_size=16",
        "data.max_response_length=512": "data.max_response_length=32",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct": (
            "actor_rollout_ref.model.path=$HOME/models/tiny"
        ),
        "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct": "critic.model.path=$HOME/models/tiny",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64": "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.total_epochs=15": "trainer.total_epochs=1",
    },
    GRPO_QWEN3: {
        "data.train_batch_size=1024": "data.train_batch_size=16",
        "data.max_response_length=1024": "data.max_response_length=32",
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B": "actor_rollout_ref.model.path=$HOME/models/tiny",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256": "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "ppo_micro_batch_size_per_gpu=32": "ppo_micro_batch_size_per_gpu=8",
        "log_prob_micro_batch_size_per_gpu=32": "log_prob_micro_batch_size_per_gpu=8",
        "tensor_model_parallel_size=2": "tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=8": "trainer.n_gpus_per_node=1",
        "trainer.total_epochs=15": "trainer.total_epochs=1",
    },
    # the same uneven split at CPU size: 10 prompts in mini-batches of 4 (4 + 4 + 2), x 3 responses
    QWEN3_QUICKSTART: {
        "data.train_batch_size=1024": "data.train_batch_size=10",
        "data.max_response_length=1024": "data.max_response_length=8",
        "actor_rollout_ref.model.path=Qwen/Qwen3-1.7B": "actor_rollout_ref.model.path=$HOME/models/tiny",
        "actor_rollout_ref.actor.ppo_mini_batch_size=80": "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "ppo_micro_batch_size_per_gpu=20": "ppo_micro_batch_size_per_gpu=4",
        "log_prob_micro_batch_size_per_gpu=20": "log_prob_micro_batch_size_per_gpu=6",
        "trainer.total_epochs=15": "trainer.total_epochs=1 trainer.total_training_steps=2",
    },
}


def small(command: str) -> str:
    for old, new in SMALL[command].items():
        assert old in command, old
        command = command.replace(old, new)
    return command


def argv_of(command: str) -> list[str]:
    """What bash would pass to main_ppo: continuation lines joined, $HOME expanded, the pipe and $@
    dropped.
    """
    words = shlex.split(os.path.expandvars(command.replace("\\\n", " ").split("2>&1")[0]))
    return [w for w in words[words.index("verl.trainer.main_ppo") + 1 :] if w != "$@"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """$HOME with ~/data/gsm8k/{train,test}.parquet (verl rows) and ~/models/tiny (a local model folder)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    rows = [
        gsm8k_row(f"What is {i} + 1?", f"{i}+1=<<{i}+1={i + 1}>>\n#### {i + 1}", "train", i) for i in range(4)
    ]
    for split in ("train", "test"):
        write_verl_parquet(rows, tmp_path / "data" / "gsm8k" / f"{split}.parquet")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    return tmp_path


@pytest.mark.parametrize("command", [PPO_QUICKSTART, GRPO_QWEN3], ids=["ppo-quickstart", "grpo-qwen3"])
def test_seed_commands_parse_as_written(home, command):
    config = load_config(argv_of(command), check=False)
    assert config.data.train_files == [str(home / "data/gsm8k/train.parquet")]
    assert config.data.source == "files"
    assert (
        config.actor_rollout_ref.rollout.name == "vllm"
        and config.actor_rollout_ref.rollout.engine == "builtin"
    )
    assert checks.problems(config) == []
    # 8 GPUs train through Ray role groups; one GPU stays one process
    assert config.uses_ray == (command is GRPO_QWEN3)


def test_qwen3_quickstart_is_accepted_as_written(home, monkeypatch):
    monkeypatch.delenv("REWARD_SERVER_URL", raising=False)
    config = load_config(argv_of(QWEN3_QUICKSTART))
    arr = config.actor_rollout_ref
    assert (config.data.train_batch_size, arr.actor.ppo_mini_batch_size) == (1024, 80)  # 12 x 80 + 64
    assert arr.actor.ppo_micro_batch_size_per_gpu == 20  # 80 x 3 = 240 sequences per GPU, 12 micro-batches
    assert config.reward_model.mode == "local"  # verl's default: scored in-process, no reward-server
    assert arr.rollout.name == "vllm" and arr.rollout.engine == "builtin"
    said = checks.notices(config)
    assert said[0].startswith("rollout: actor_rollout_ref.rollout.name=vllm is not wired in yet")


def test_top_k_zero_is_off_and_a_shuffle_between_epochs_is_said_to_do_nothing():
    from trainer.build import sampling_params

    config = load_config(
        ["actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.actor.shuffle=true", "critic.shuffle=true"]
    )
    rollout = config.actor_rollout_ref.rollout
    assert sampling_params(rollout, 16, validation=False).top_k == -1  # SamplingParams refuses 0
    assert sampling_params(rollout, 16, validation=True).top_k == -1
    # verl's FSDP workers do not shuffle either; here the notice says so instead of a silent key
    assert {"actor_rollout_ref.actor.shuffle", "critic.shuffle"} <= set(config.no_effect_keys)


def test_tensor_parallel_size_says_where_it_acts(home, monkeypatch):
    # verl's Qwen3-8B GRPO example asks for rollout tp 2 with vllm, which runs on the built-in engine here
    monkeypatch.delenv("REWARD_SERVER_URL", raising=False)
    config = load_config(argv_of(GRPO_QWEN3))
    assert (
        "rollout: tensor_model_parallel_size=2 applies to SGLang servers; the builtin engine holds the "
        "whole model on each policy rank's GPU"
    ) in checks.notices(config)
    sglang = load_config(argv_of(GRPO_QWEN3) + ["actor_rollout_ref.rollout.name=sglang"])
    assert not any("tensor_model_parallel_size" in line for line in checks.notices(sglang))
    two_nodes = load_config(["actor_rollout_ref.rollout.name=sglang", "trainer.nnodes=2"])
    assert any("started on this node's GPUs only" in line for line in checks.notices(two_nodes))


def test_ppo_quickstart_small(home):
    config = load_config(argv_of(small(PPO_QUICKSTART)))
    arr, critic = config.actor_rollout_ref, config.critic
    assert config.algorithm.adv_estimator == "gae" and config.use_critic  # verl's default estimator: PPO
    assert not config.use_reference  # no KL loss, no KL in reward
    assert arr.model.path == critic.model.path == str(home / "models/tiny")
    assert arr.actor.optim.lr == 1e-6 and critic.optim.lr == 1e-5
    assert (
        config.data.train_batch_size,
        arr.actor.ppo_mini_batch_size,
        arr.actor.ppo_micro_batch_size_per_gpu,
    ) == (16, 8, 4)
    assert critic.ppo_mini_batch_size == 8  # inherited from the actor, as verl does
    assert critic.ppo_micro_batch_size_per_gpu == 4 and critic.ppo_epochs == 1
    assert (
        arr.rollout.log_prob_micro_batch_size_per_gpu == 8 and arr.ref.log_prob_micro_batch_size_per_gpu == 4
    )
    assert arr.rollout.response_length == 32 and arr.rollout.prompt_length == 512
    assert config.algorithm.kl_ctrl.kl_coef == 0.001
    assert config.trainer.logger == ["console"]  # a bare word becomes a one-item list
    assert config.trainer.val_before_train is False and config.trainer.total_epochs == 1
    assert (config.trainer.save_freq, config.trainer.test_freq) == (10, 10)
    assert config.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_grpo_qwen3_small(home):
    config = load_config(argv_of(small(GRPO_QWEN3)))
    arr = config.actor_rollout_ref
    assert config.algorithm.adv_estimator == "grpo" and not config.use_critic and config.use_reference
    assert (
        arr.actor.use_kl_loss and arr.actor.kl_loss_type == "low_var_kl" and arr.actor.kl_loss_coef == 0.001
    )
    assert arr.rollout.n == 5 and arr.actor.entropy_coeff == 0
    assert config.data.filter_overlong_prompts is True and config.data.truncation == "error"
    assert config.trainer.logger == ["console", "wandb"]
    assert config.trainer.default_local_dir == "checkpoints/verl_grpo_example_gsm8k/qwen3_8b_function_rm"
    assert config.world_size == 1
    # every verl key of the command acts here (gpu_memory_utilization sizes the built-in engine's KV cache)
    assert config.no_effect_keys == []
    assert arr.rollout.gpu_memory_utilization == 0.6
    assert arr.model.use_remove_padding and arr.ref.fsdp_config.param_offload
    assert not arr.actor.fsdp_config.param_offload and config.critic.model.use_remove_padding  # the policy's
    # the offload acts on one GPU too (its one rank is sharded by FSDP2 like any other): no notice
    assert checks.notices(config) == [
        "rollout: actor_rollout_ref.rollout.name=vllm is not wired in yet; the built-in engine "
        "(continuous batching, on each policy rank) generates instead",
    ]
    assert "param_offload: true" in config.resolved_yaml()


def test_dynamic_batch_keys_become_token_budgets(home):
    from trainer.config.derive import log_prob_micro_batch
    from trainer.workers.common import TokenBudget

    base = argv_of(small(GRPO_QWEN3))
    config = load_config(base)  # off by default: sequence counts
    arr = config.actor_rollout_ref
    assert not arr.actor.use_dynamic_bsz and not config.critic.use_dynamic_bsz
    assert log_prob_micro_batch(arr.rollout) == arr.rollout.log_prob_micro_batch_size_per_gpu
    config = load_config(
        base
        + [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8000",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24000",
            "critic.use_dynamic_bsz=false",
        ]
    )
    arr = config.actor_rollout_ref
    assert config.no_effect_keys == []  # verl's keys act now
    assert arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu == 8000
    assert log_prob_micro_batch(arr.rollout) == TokenBudget(8000)  # the actor's, as verl
    assert log_prob_micro_batch(arr.ref) == TokenBudget(24000)
    assert not config.critic.use_dynamic_bsz


def test_fsdp_mixed_precision_picks_what_parameters_are_gathered_in(home):
    import torch

    from trainer.parallel.settings import model_settings
    from trainer.model import Precision

    gpu = Precision(param_dtype=torch.float32, autocast_dtype=torch.bfloat16)
    base = argv_of(small(GRPO_QWEN3))
    arr = load_config(base).actor_rollout_ref  # verl's default: bf16 gathers (computed under autocast)
    settings = model_settings(arr.model, arr.actor.fsdp_config, gpu)
    assert settings.fsdp.param_dtype == torch.bfloat16 and settings.autocast_dtype == torch.bfloat16
    fp32 = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"
    config = load_config(
        base + [fp32, "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32"]
    )
    assert config.no_effect_keys == []  # verl's key acts now
    arr = config.actor_rollout_ref
    settings = model_settings(arr.model, arr.actor.fsdp_config, gpu)
    assert settings.fsdp.param_dtype is None and settings.autocast_dtype == torch.bfloat16
    assert settings.compute_dtype == torch.bfloat16  # what the engine and HF exports get
    reference = model_settings(arr.model, arr.ref.fsdp_config, gpu, trainable=False)  # its own key
    assert reference.fsdp.param_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="mixed_precision.param_dtype"):
        load_config(base + ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=int8"])


def test_main_ppo_dry_run_prints_resolved_config(home):
    argv = argv_of(small(GRPO_QWEN3)) + ["--dry-run"]
    env = {**os.environ, "HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main_ppo", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "adv_estimator: grpo" in done.stdout
    assert "default_local_dir: checkpoints/verl_grpo_example_gsm8k/qwen3_8b_function_rm" in done.stdout
    assert "ppo_micro_batch_size_per_gpu: 8" in done.stdout
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("accepted, no effect here: ")] == []
    assert not [line for line in lines if line.startswith("fsdp: ")]  # the offload acts on one GPU too
    assert sum("not wired in yet" in line for line in lines) == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["actor_rollout_ref.actor.ppo_mini_batchsize=4"],
            (
                "unknown key 'actor_rollout_ref.actor.ppo_mini_batchsize'; "
                "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?"
            ),
        ),
        (["trainer.loger=console"], "did you mean 'trainer.logger'?"),
        (["data.train_batch_size=many"], "data.train_batch_size: Input should be a valid integer"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator: Input should be 'gae', 'grpo'"),
        (["trainer.logger=[console,mlflow]"], "trainer.logger[1]: Input should be 'console'"),
        (
            ["actor_rollout_ref.actor.clip_ratio_low=1.5"],
            "actor_rollout_ref.actor.clip_ratio_low: Input should be less than 1",
        ),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "clip_ratio_c: Input should be greater than 1"),
        (["actor_rollout_ref.actor=3"], "'actor_rollout_ref.actor' is a section, not a value"),
        (["data.train_batch_size"], "expected key=value, got 'data.train_batch_size'"),
        (["data.train_files=a.parquet,b.parquet"], "is a Hydra sweep, not a value: write"),
        (["~trainer.loger"], "unknown key 'trainer.loger'; did you mean 'trainer.logger'?"),
        (["trainer.seed=3", "~trainer.seed=4"], "~trainer.seed=4: its value is 3, not that"),
        (["trainer.role_pools=apart"], "trainer.role_pools: Input should be 'colocated' or 'separate'"),
        (["trainer.logger={a: 1}"], "trainer.logger: Input should be a valid list"),  # a map for a list
        (["trainer.logger=[x]", "trainer.logger={a: 1}"], "trainer.logger: Input should be a valid list"),
        (["trainer.experiment_name=${oc.env:RL_JOBGROUP_TEST_UNSET}"], "RL_JOBGROUP_TEST_UNSET"),
        (["data.train_files=/nope/train.parquet"], "data.train_files: /nope/train.parquet does not exist"),
        (
            ["actor_rollout_ref.model.path=/nope/model"],
            "actor_rollout_ref.model.path: /nope/model does not exist",
        ),
        (["actor_rollout_ref.model.lora_rank=8"], "actor_rollout_ref.model.lora_rank: not supported"),
        (
            ["trainer.resume_mode=resume_path"],
            "trainer.resume_mode=resume_path needs trainer.resume_from_path",
        ),
        (
            ["algorithm.filter_groups.enable=true"],
            "algorithm.filter_groups.enable needs actor_rollout_ref.rollout.n >= 2",
        ),
        (
            ["trainer.default_local_dir=ckpt/${trainer.nope}"],
            "trainer.default_local_dir: Interpolation key 'trainer.nope' not found",
        ),
    ],
)
def test_bad_input_names_the_key(argv, needle):
    with pytest.raises(ConfigError) as caught:
        load_config(argv)
    assert any(needle in problem for problem in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(
    "overrides, needle",
    [
        # 12 prompts * n=1 over 8 GPUs
        (
            [
                "data.train_batch_size=12",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "trainer.n_gpus_per_node=8",
            ],
            "data.train_batch_size * actor_rollout_ref.rollout.n = 12 responses per step must split "
            "evenly over 8 GPU(s)",
        ),
        (
            ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            "actor_rollout_ref.actor.ppo_mini_batch_size (16) is larger than data.train_batch_size (8)",
        ),
        # mini 4 prompts * n 3 = 12 sequences on 1 GPU; micro 5 does not divide 12
        (
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.rollout.n=3",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
            ],
            "= 12 sequences per GPU must be divisible by "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (5)",
        ),
        # the critic's own mini-batch: larger than the step's 8 prompts
        (
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "critic.ppo_mini_batch_size=16",
            ],
            "critic.ppo_mini_batch_size (16) is larger than data.train_batch_size (8)",
        ),
        (
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            ],
            (
                "set only one of actor_rollout_ref.actor.ppo_micro_batch_size (deprecated, global) and "
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
            ),
        ),
        (
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            ],
            "actor_rollout_ref.rollout.tensor_model_parallel_size (4) must divide the 2 GPU(s)",
        ),
        # the engine's context is rollout.prompt_length + response_length: the prompts must fit
        (
            ["data.max_prompt_length=64", "actor_rollout_ref.rollout.prompt_length=32"],
            "actor_rollout_ref.rollout.prompt_length (32) is less than data.max_prompt_length (64)",
        ),
        # one process trains on one device: it cannot be given two GPUs
        (
            ["trainer.n_gpus_per_node=2", "trainer.use_ray=false"],
            "trainer.use_ray=false trains in this one process on one device, but "
            "trainer.nnodes * trainer.n_gpus_per_node = 2 GPUs",
        ),
    ],
)
def test_batch_size_divisibility(overrides, needle):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides)
    assert any(needle in problem for problem in caught.value.problems), caught.value.problems


def test_shared_prompts_need_packed_forwards_and_a_critic_that_inherits_both_is_told_once():
    with pytest.raises(ConfigError) as caught:
        load_config(["algorithm.adv_estimator=gae", "actor_rollout_ref.model.share_prompts=true"])
    assert caught.value.problems == [
        "actor_rollout_ref.model.share_prompts needs actor_rollout_ref.model.use_remove_padding=true (a "
        "shared prompt is a packed layout; a padded batch has a row per sample)"
    ]
    on = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.share_prompts=true"]
    with pytest.raises(ConfigError, match="critic.model.share_prompts needs critic.model.use_remove_padding"):
        load_config(["algorithm.adv_estimator=gae", *on, "critic.model.use_remove_padding=false"])
    config = load_config(["algorithm.adv_estimator=gae", *on])
    assert config.critic.model.share_prompts and checks.problems(config) == []


@pytest.mark.parametrize(
    "overrides",
    [
        # verl's Qwen3 GSM8K quickstart sizes: 1024 prompts in mini-batches of 80, the 13th one of 64
        ["data.train_batch_size=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=80"],
        ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
         "critic.ppo_mini_batch_size=5"],
        # DAPO: fewer prompts per generation round than per step just takes more rounds
        ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.gen_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true",
         "algorithm.adv_estimator=grpo"],
    ],
)  # fmt: skip
def test_what_verl_accepts_is_accepted(overrides):
    assert checks.problems(load_config(overrides)) == []


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        load_config(["trainer.loger=x", "data.max_prompt_lenght=3", "critic.optim.lrr=1"])
    assert len(caught.value.problems) == 3


def test_derived_values_follow_verl():
    config = load_config(
        [
            "data.train_batch_size=32",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size=4",  # deprecated, global
            "actor_rollout_ref.actor.clip_ratio=0.25",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "trainer.project_name=p",
            "trainer.experiment_name=007",
            "algorithm.adv_estimator=grpo",
        ],
        check=False,
    )
    assert checks.problems(config) == []
    actor = config.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size_per_gpu == 2 and actor.ppo_micro_batch_size is None  # 4 global / 2 GPUs
    assert actor.clip_ratio_low == 0.25 and actor.clip_ratio_high == 0.28  # DAPO clip-higher
    assert actor.optim.lr_scheduler_type == "cosine"
    assert (
        config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 2
    )  # falls back to the actor's
    assert config.trainer.experiment_name == "007"  # text stays text
    assert config.trainer.default_local_dir == "checkpoints/p/007"
    assert config.data.gen_batch_size == 32 and config.data.seed == config.trainer.seed == 1
    assert config.critic.enable is False  # no critic for grpo
    # the printed config round-trips to the same config
    again = Config.model_validate(config.model_dump())
    assert again == config and checks.problems(again) == checks.problems(config)


def test_yaml_file_then_overrides(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        "algorithm:\n  adv_estimator: rloo\n"
        "actor_rollout_ref:\n  rollout: {n: 4, temperature: 0.7}\n  actor: {ppo_mini_batch_size: 4}\n"
        "data: {train_batch_size: 8, val_batch_size: None}\n"
        "trainer:\n  logger: [console, jsonl]\n  experiment_name: from-yaml\n"
        "  default_local_dir: /ckpt/${trainer.experiment_name}\n"
        "critic:\n  _target_: verl.workers.config.FSDPCriticConfig\n"  # verl's yaml noise is tolerated
        "  ppo_epochs: ${actor_rollout_ref.actor.ppo_epochs}\n"  # a typed reference
    )
    config = load_config(
        [
            "--config",
            str(run),
            "actor_rollout_ref.rollout.n=2",
            "+trainer.experiment_name=cli",
            "actor_rollout_ref.actor.ppo_epochs=3",
        ]
    )
    assert config.critic.ppo_epochs == 3
    assert config.algorithm.adv_estimator == "rloo"
    assert config.actor_rollout_ref.rollout.n == 2 and config.actor_rollout_ref.rollout.temperature == 0.7
    assert config.data.val_batch_size is None
    assert config.trainer.logger == ["console", "jsonl"]
    assert config.trainer.default_local_dir == "/ckpt/cli"  # references resolve after every override
    assert load_config([f"config={run}"]).trainer.experiment_name == "from-yaml"
    (tmp_path / "bad.yaml").write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(["--config", str(tmp_path / "bad.yaml")])


def test_values_are_read_as_hydra_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",  # a float, not the text "1e-6"
            "trainer.val_before_train=False",
            "trainer.logger=['console','jsonl']",
            "actor_rollout_ref.rollout.stop=['</answer>', 'a,b']",  # a quoted comma stays in its item
            "trainer.experiment_name=007",  # a text key keeps the text as written
            "trainer.project_name='1.50'",
            "data.val_batch_size=null",
            "data.val_split=None",  # the text None on a nullable key means null
            "data.train_files=~/data/x.parquet",  # a home path, though Hydra's grammar has no bare ~
            "+data.apply_chat_template_kwargs.enable_thinking=False",  # open mappings get typed values
            "data.apply_chat_template_kwargs.tools={name: search, args: [q, 3]}",
        ],
        check=False,
    )
    assert config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert config.trainer.val_before_train is False and config.trainer.logger == ["console", "jsonl"]
    assert config.actor_rollout_ref.rollout.stop == ["</answer>", "a,b"]
    assert (config.trainer.experiment_name, config.trainer.project_name) == ("007", "1.50")
    assert config.data.val_batch_size is None and config.data.val_split is None
    assert config.data.train_files == [str(tmp_path / "data/x.parquet")]
    assert config.data.apply_chat_template_kwargs == {
        "enable_thinking": False,
        "tools": {"name": "search", "args": ["q", 3]},
    }


def test_plus_and_tilde_overrides():
    # +key and ++key set a key (known or in an open mapping); Hydra's + on an existing key is accepted
    config = load_config(["+trainer.seed=7", "++trainer.total_epochs=2", "+trainer.val_only=true"])
    assert (config.trainer.seed, config.trainer.total_epochs, config.trainer.val_only) == (7, 2, True)
    # ~key drops what was set before it: the default applies again
    config = load_config(
        ["trainer.seed=7", "trainer.logger=[console,jsonl]", "~trainer.seed", "~trainer.logger"]
    )
    assert config.trainer.seed == 1 and config.trainer.logger == ["console"]
    # ~key=value only when the current value is value (the default counts)
    assert load_config(["~trainer.seed=1"]).trainer.seed == 1
    # ~ on a key nobody set is fine, as for any key verl's config holds
    assert load_config(["~actor_rollout_ref.actor.clip_ratio"]).actor_rollout_ref.actor.clip_ratio == 0.2
    # + on an unknown key is still an unknown key: the schema is closed
    with pytest.raises(ConfigError, match="unknown key 'trainer.sed'; did you mean 'trainer.seed'"):
        load_config(["+trainer.sed=7"])


def test_key_null_clears_a_nullable_key_and_is_refused_where_null_means_nothing():
    config = load_config(["data.seed=5", "data.seed=null", "trainer.total_training_steps=null"])
    assert config.data.seed == config.trainer.seed  # null: the rule (trainer.seed) applies again
    assert config.trainer.total_training_steps is None
    with pytest.raises(ConfigError, match="data.train_batch_size: Input should be a valid integer"):
        load_config(["data.train_batch_size=null"])


def test_interpolation_and_oc_env(monkeypatch):
    monkeypatch.setenv("RL_JOBGROUP_TEST_EXPERIMENT", "from-env")
    monkeypatch.delenv("RL_JOBGROUP_TEST_UNSET", raising=False)
    config = load_config(
        [
            "trainer.experiment_name=${oc.env:RL_JOBGROUP_TEST_EXPERIMENT,fallback}",
            "trainer.project_name=${oc.env:RL_JOBGROUP_TEST_UNSET,proj}",
            "trainer.total_epochs=${oc.env:RL_JOBGROUP_TEST_UNSET,4}",  # env text, typed by the schema
            "data.seed=${trainer.total_epochs}",  # a whole-value reference keeps the referenced type
            "trainer.log_dir=/runs/${trainer.project_name}/${trainer.experiment_name}",
            "trainer.rollout_data_dir=${oc.select:trainer.nope,/tmp/rollouts}",
        ]
    )
    assert config.trainer.experiment_name == "from-env" and config.trainer.project_name == "proj"
    assert config.trainer.total_epochs == 4 and config.data.seed == 4
    assert config.trainer.log_dir == "/runs/proj/from-env"
    assert config.trainer.default_local_dir == "checkpoints/proj/from-env"  # the default's own references
    assert config.trainer.rollout_data_dir == "/tmp/rollouts"


def test_yaml_through_omegaconf_then_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_JOBGROUP_TEST_LR", "3e-6")
    base, extra = tmp_path / "base.yaml", tmp_path / "extra.yaml"
    base.write_text(
        "actor_rollout_ref:\n"
        "  actor:\n"
        "    optim: {lr: '${oc.env:RL_JOBGROUP_TEST_LR,1e-6}'}\n"
        "    fsdp_config: {wrap_policy: {min_num_params: 0}}\n"  # a no-effect verl key: accepted, reported
        "  rollout: {n: 4, stop: [x]}\n"
        "trainer: {experiment_name: base, logger: [console, jsonl], seed: 5}\n"
    )
    extra.write_text("actor_rollout_ref:\n  rollout: {n: 6}\ntrainer: {experiment_name: extra}\n")
    config = load_config(
        ["--config", str(base), f"--config={extra}", "actor_rollout_ref.rollout.n=2", "~trainer.seed"]
    )
    assert config.actor_rollout_ref.actor.optim.lr == 3e-6  # env text typed as a float
    assert config.actor_rollout_ref.rollout.n == 2  # the override wins over both files
    assert config.actor_rollout_ref.rollout.stop == ["x"]  # the later file merged in, not replaced
    assert config.trainer.experiment_name == "extra" and config.trainer.logger == ["console", "jsonl"]
    assert config.trainer.seed == 1  # ~ dropped the file's value
    assert config.no_effect_keys == ["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params"]


def test_services_urls_come_from_env(monkeypatch):
    monkeypatch.setenv("DATA_SERVER_URL", "http://data-0.group:8000, http://data-1.group:8000")
    monkeypatch.delenv("REWARD_SERVER_URL", raising=False)
    config = load_config(["services.auth_token=s3cret"])
    assert config.services.data_url == ["http://data-0.group:8000", "http://data-1.group:8000"]
    assert config.services.reward_url == [] and config.reward_model.mode == "local"  # verl's default
    assert "s3cret" not in config.resolved_yaml() and "auth_token: '***'" in config.resolved_yaml()
    config = load_config(["services.reward_url=http://r:1"])
    assert config.services.reward_url == ["http://r:1"] and config.reward_model.mode == "server"
    config = load_config(["services.reward_url='http://r:1,http://s:1'"])  # replicas, quoted as Hydra wants
    assert config.services.reward_url == ["http://r:1", "http://s:1"]
    monkeypatch.setenv("REWARD_SERVER_URL", "http://reward-server:8001")
    assert load_config([]).reward_model.mode == "server"  # the job group sets the URL: the server scores
    assert load_config(["reward_model.mode=local"]).reward_model.mode == "local"


def test_main_ppo_errors_are_one_line_each_exit_2():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.main_ppo",
            "actor_rollout_ref.actor.ppo_mini_batchsize=4",
            "trainer.nnodes=0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "error: unknown key 'actor_rollout_ref.actor.ppo_mini_batchsize'; "
        "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?"
    )
    assert lines[1] == "error: trainer.nnodes: Input should be greater than or equal to 1 (got 0)"
    assert lines[2].startswith("(python -m trainer.main_ppo --help") and len(lines) == 3
    helped = subprocess.run(
        [sys.executable, "-m", "trainer.main_ppo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert helped.returncode == 0 and "python -m trainer.config --markdown" in helped.stdout


def test_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import trainer.config, trainer.main_ppo, trainer.data\n"
        "config = trainer.config.load_config(['algorithm.adv_estimator=grpo'])\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(config.algorithm.adv_estimator)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "grpo"


def test_reference_markdown_covers_every_key():
    markdown = config_reference_markdown()
    leaves = [k for k in config_keys() if f"`{k}`" in markdown]
    sections = {k.rpartition(".")[0] for k in config_keys() if "." in k}
    assert set(leaves) | sections >= set(config_keys()) - {
        "data",
        "actor_rollout_ref",
        "critic",
        "reward_model",
        "custom_reward_function",
        "algorithm",
        "trainer",
        "services",
    }
    assert "| `critic.optim.lr` | float | 1e-05 |" in markdown  # the critic's own default, not the actor's
    assert "| `actor_rollout_ref.rollout.prompt_length` | int or null | null |" in markdown
    assert "`$DATA_SERVER_URL`, else `http://127.0.0.1:8000`" in markdown
    assert "`$REWARD_SERVER_URL`, else `none`" in markdown
    tables = markdown.split("## verl keys accepted with no effect")[0]
    assert "ulysses_sequence_parallel_size" not in tables and "fsdp_config.wrap_policy" not in tables
    assert "`actor_rollout_ref.actor.fsdp_config.wrap_policy`" in markdown  # no-effect keys: named once,
    assert "`actor_rollout_ref.actor.ulysses_sequence_parallel_size`" in markdown  # after the tables
    done = subprocess.run(
        [sys.executable, "-m", "trainer.config", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout == markdown


def test_model_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    assert load_config(["actor_rollout_ref.model.path=~/m"]).actor_rollout_ref.model.path == str(
        tmp_path / "m"
    )
    assert load_config([f"actor_rollout_ref.model.path={tmp_path / 'small.gguf'}"])
    assert load_config(
        ["actor_rollout_ref.model.path=unsloth/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q4_K_M.gguf"]
    )  # hub GGUF
    assert load_config(["actor_rollout_ref.model.path=gpt2"])  # a bare hub name
    for path, needle in [
        ("~/empty", "holds neither config.json nor a .gguf file"),
        ("./missing.gguf", "./missing.gguf does not exist"),
        ("a/b/c", "a/b/c does not exist"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_config([f"actor_rollout_ref.model.path={path}"])


@pytest.mark.parametrize("name", ["grpo_gsm8k", "ppo_gsm8k", "dapo_gsm8k", "tiny_cpu"])
def test_example_configs_load(home, name, monkeypatch):
    monkeypatch.setenv("REWARD_SERVER_URL", "http://127.0.0.1:8001")  # as the job group sets it
    config = load_config(
        [
            "--config",
            str(ROOT / "trainer" / "configs" / f"{name}.yaml"),
            "actor_rollout_ref.model.path=~/models/tiny",
        ]
    )
    expected = {"grpo_gsm8k": "grpo", "ppo_gsm8k": "gae", "dapo_gsm8k": "grpo", "tiny_cpu": "grpo"}[name]
    assert config.algorithm.adv_estimator == expected
    assert config.use_critic == (name == "ppo_gsm8k")
    if name == "ppo_gsm8k":
        assert config.data.train_files == [str(home / "data/gsm8k/train.parquet")]  # ~ expanded


def test_batch_size_problems_never_blame_a_critic_the_user_did_not_ask_for():
    too_big = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    # GRPO has no critic; under the default estimator (gae) the critic inherits the actor's mini-batch:
    # either way the actor's key is the one named, once
    for estimator in (["algorithm.adv_estimator=grpo"], []):
        with pytest.raises(ConfigError) as caught:
            load_config([*too_big, *estimator])
        assert [p for p in caught.value.problems if "mini_batch" in p] == [
            "actor_rollout_ref.actor.ppo_mini_batch_size (4) is larger than data.train_batch_size (2)"
        ]
    # the critic's own size, under the default estimator: named, with why there is a critic at all
    with pytest.raises(ConfigError) as caught:
        load_config(["data.train_batch_size=8", "critic.ppo_mini_batch_size=16"])
    assert any(
        p.startswith("critic.ppo_mini_batch_size (16) is larger")
        and "algorithm.adv_estimator=gae, the default" in p
        for p in caught.value.problems
    ), caught.value.problems
    # GRPO ignores critic keys: no critic, nothing to check
    grpo = ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", "critic.ppo_mini_batch_size=16"]
    assert checks.problems(load_config([*grpo, "actor_rollout_ref.actor.ppo_mini_batch_size=8"])) == []


def test_verl_07_reward_layout_reaches_the_same_keys(tmp_path):
    """verl 0.7 moved the reward keys under `reward.*` (and sandbox_fusion to the top): both layouts
    set the same fields, on the command line and in YAML; two different values for one field are refused."""
    new = load_config(
        [
            "reward.custom_reward_function.path=/tmp/score.py",
            "reward.custom_reward_function.name=score",
            "reward.sandbox_fusion.url=http://code:8003/run_code",
            "reward.reward_manager.name=dapo",
        ],
        check=False,
    )
    old = load_config(
        [
            "custom_reward_function.path=/tmp/score.py",
            "custom_reward_function.name=score",
            "reward_model.sandbox_fusion.url=http://code:8003/run_code",
            "reward_model.reward_manager=dapo",
        ],
        check=False,
    )
    assert new.model_dump() == old.model_dump()
    assert new.no_effect_keys == ["reward_model.reward_manager"]
    assert (
        load_config(["sandbox_fusion.url=http://b/run_code"]).reward_model.sandbox_fusion.url
        == "http://b/run_code"
    )

    run = tmp_path / "run.yaml"
    run.write_text(
        "reward:\n  custom_reward_function: {path: /tmp/a.py, name: compute_score}\n"
        "  sandbox_fusion: {url: null, max_concurrent: 64}\n"
        "custom_reward_function: {path: null, name: null}\n"  # verl's old keys left null: the new ones hold
    )
    config = load_config(["--config", str(run)], check=False)
    assert config.custom_reward_function.path == "/tmp/a.py"
    run.write_text(
        "reward:\n  custom_reward_function: {path: /tmp/a.py}\ncustom_reward_function: {path: /tmp/b.py}\n"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", str(run)], check=False)
    assert (
        "reward.custom_reward_function.path='/tmp/a.py' and custom_reward_function.path='/tmp/b.py'"
        in str(refused.value)
    )


VERL_GENERATED = ROOT / ".verl" / "verl" / "trainer" / "config" / "_generated_ppo_trainer.yaml"


@pytest.mark.skipif(
    not VERL_GENERATED.is_file(), reason="verl is not installed in .verl (.ci/run installs it)"
)
def test_verl_07_generated_config_loads_whole():
    """verl 0.7.1's own full config (every key main_ppo knows, `???` where it must be set) is read: each key
    either sets a field or is accepted with no effect; only its example paths, absent here, are problems."""
    with pytest.raises(ConfigError) as problems:
        load_config(["--config", str(VERL_GENERATED)])
    assert all("does not exist" in problem for problem in problems.value.problems), problems.value.problems
    config = load_config(["--config", str(VERL_GENERATED)], check=False)
    assert config.actor_rollout_ref.rollout.name == "auto"  # `???` there: the default here
    assert config.custom_reward_function.name == "compute_score"
    assert "actor_rollout_ref.actor.checkpoint.async_save" in config.no_effect_keys


@pytest.mark.parametrize("hardware", [True, False], ids=["avx512-bf16", "avx2-only"])
def test_bf16_on_a_cpu_without_bf16_hardware_runs_fp32_and_says_so(monkeypatch, hardware):
    """On an AVX2-only CPU (an AMD EPYC here) torch's bf16 matmul is ~70x slower than fp32: the demo's
    trainer.mixed_precision=bf16 took over 10 minutes for one update there. Without the hardware the run
    computes in fp32 and says so once; with it bf16 stays."""
    import trainer.model
    from trainer.config import derive

    monkeypatch.setattr(derive, "fast_bf16_cpu", lambda: hardware)
    monkeypatch.setattr(trainer.model, "fast_bf16_cpu", lambda: hardware)
    config = load_config(["trainer.device=cpu", "trainer.mixed_precision=bf16"], check=False)
    said = [line for line in checks.notices(config) if "mixed_precision" in line]
    precision = trainer.model.default_precision("cpu", config.trainer.mixed_precision)
    if hardware:
        assert said == [] and precision.autocast_dtype is not None
    else:
        assert said and "the run computes in fp32" in said[0] and precision.autocast_dtype is None
    assert trainer.model.default_precision("cpu", "auto").autocast_dtype is None  # auto: fp32 on a CPU
    assert trainer.model.default_precision("cpu", "fp32").autocast_dtype is None


def test_seq_final_reward_with_kl_in_reward_says_it_reads_the_scores(home):
    # groups are filtered before the in-reward KL penalty is computed (it needs the kept batch's
    # reference logprobs): the start says so instead of reading seq_final_reward as seq_reward silently
    dapo = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward"]
    dapo.append("actor_rollout_ref.rollout.n=4")
    with_kl = load_config(dapo + ["algorithm.use_kl_in_reward=true"])
    assert any("metric=seq_final_reward reads the scores" in line for line in checks.notices(with_kl))
    assert not any("seq_final_reward" in line for line in checks.notices(load_config(dapo)))
