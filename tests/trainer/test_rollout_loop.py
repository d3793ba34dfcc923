"""The fit loop with each rollout engine: `python -m trainer.main_ppo ... actor_rollout_ref.rollout.name=X`.

builtin: the fast engine in process, synced from the policy after every update, its logprob gap to
the trainer logged every step (verl's training/rollout_probs_diff_*). sglang: rollout servers at
ROLLOUT_SERVER_URLS (here the built-in server, which speaks SGLang's API; SGLang itself cannot be
installed here), the weights synced through /update_weights_from_disk.

And the loop's failures: rewards that cannot be computed (all of them, or a share), and a service that
fails in validation after the step's update.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch

from tests.e2e.test_train_e2e import common_args, metrics_of, seven_data, tiny_model, train  # noqa: F401
from tests.helpers import service_process
from trainer.checkpoint import RNG_FILE, load_role_weights, load_train_state


def local_args(model, data, workdir) -> list[str]:
    return common_args(model, workdir, 2) + [
        f"data.train_files={data / 'parquet/train.parquet'}",
        "reward_model.mode=local",
        "trainer.save_freq=-1",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ]


@pytest.mark.parametrize("mini_batch", [4, 2], ids=["on-policy", "two-optimizer-steps"])
def test_builtin_engine_trains_and_logs_its_logprob_gap(tiny_model, seven_data, tmp_path, mini_batch):  # noqa: F811
    args = local_args(tiny_model, seven_data, tmp_path) + ["actor_rollout_ref.rollout.name=builtin"]
    train(args + [f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}"])
    steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for metrics in steps:
        # exactly on-policy, the update's own forward stands in for old_log_prob and measures the gap;
        # with two optimizer steps the second mini-batch needs the logprobs from before the first
        assert ("timing_s/old_log_prob" in metrics) == (mini_batch == 2)
        assert ("training/rollout_probs_diff_max" in metrics) == (mini_batch == 2)
        assert metrics["training/rollout_probs_diff_valid"] == 1.0
        # the engine's logprobs match the trainer's (fp32, CPU)
        assert metrics["training/rollout_probs_diff_mean"] < 1e-4
        # the step's phases, the driver's own included (prompts, KV resume/release, the padded batch),
        # are parts of timing_s/step, none counted twice
        phases = {k: v for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"}
        assert {"timing_s/data", "timing_s/kv_memory", "timing_s/batch"} <= set(phases)
        assert sum(phases.values()) <= metrics["timing_s/step"]
    # the gap stays small at step 2: the engine got the updated weights (a stale engine would drift)
    assert steps[1]["training/rollout_logprob_diff_mean"] < 1e-4


def test_sglang_name_drives_the_servers_at_rollout_server_urls(tiny_model, seven_data, tmp_path):  # noqa: F811
    args = (
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--max-running-requests",
        "16",
        "--context-length",
        "256",
    )
    # the server asks for the token the services get (services.auth_token): the trainer must send it
    token = {"ROLLOUT_SERVER_AUTH_TOKEN": "s3cret"}
    with service_process("trainer.rollout.server", *args, env=token) as (url, _):
        assert httpx.post(url + "/generate", json={"input_ids": [1]}).status_code == 401
        train(
            local_args(tiny_model, seven_data, tmp_path)
            + ["actor_rollout_ref.rollout.name=sglang", "services.auth_token=s3cret"],
            env={"ROLLOUT_SERVER_URLS": url},
        )
        steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
        assert [m["step"] for m in steps] == [1, 2]
        assert all(m["training/rollout_probs_diff_mean"] < 1e-4 for m in steps)
        # after each update the trainer wrote a checkpoint and the server loaded it
        info = httpx.get(url + "/get_model_info", headers={"Authorization": "Bearer s3cret"}).json()
        assert info["model_path"] != str(tiny_model)


def test_a_run_whose_rewards_cannot_be_computed_stops_in_one_line(tiny_model, seven_data, tmp_path):  # noqa: F811
    """A data_source no scorer knows scores every sample 0 with an error: training on those zeros would
    teach nothing, so the run stops at step 1 naming the share and the first error."""
    rows = pd.read_parquet(seven_data / "parquet/train.parquet")
    rows["data_source"] = "no-such-benchmark"
    (tmp_path / "data" / "parquet").mkdir(parents=True)
    rows.to_parquet(tmp_path / "data" / "parquet/train.parquet")
    args = local_args(tiny_model, tmp_path / "data", tmp_path) + ["reward_model.max_error_fraction=0.5"]
    done = train(args, check=False)
    assert done.returncode != 0
    assert "16 of 16 rewards could not be computed" in done.stderr
    assert "reward_model.max_error_fraction 0.5" in done.stderr and "no-such-benchmark" in done.stderr
    assert "Traceback" not in done.stderr.splitlines()[-1]


def unscorable_test_split(data: Path, workdir: Path) -> Path:
    """The test split with a data_source no scorer knows: every validation reward is an error."""
    rows = pd.read_parquet(data / "parquet/test.parquet")
    rows["data_source"] = "no-such-benchmark"
    (workdir / "data" / "parquet").mkdir(parents=True)
    rows.to_parquet(workdir / "data" / "parquet/test.parquet")
    return workdir / "data" / "parquet/test.parquet"


def test_a_validation_whose_rewards_cannot_be_computed_stops_in_one_line(tiny_model, seven_data, tmp_path):  # noqa: F811
    """trainer.val_only over a validation split no scorer knows: its accuracy of 0 would read as
    measured, so validation stops as a training round does, naming the share and the first error."""
    args = local_args(tiny_model, seven_data, tmp_path) + [
        f"data.val_files={unscorable_test_split(seven_data, tmp_path)}",
        "trainer.val_only=true",
    ]
    done = train(args, check=False)
    assert done.returncode != 0
    assert "rewards could not be computed" in done.stderr and "no-such-benchmark" in done.stderr
    assert "Traceback" not in done.stderr.splitlines()[-1]


def test_a_validation_without_rewards_mid_run_keeps_the_steps_before_it(tiny_model, seven_data, tmp_path):  # noqa: F811
    """Step 2's validation gets only reward errors (as a scorer's outage gives them: per item): the run
    stops as it does when a service stays down, keeping steps 1 and 2, their rows and step 2 saved, though
    save_freq is past the run. Unkept, a resumed run would train them again."""
    args = local_args(tiny_model, seven_data, tmp_path) + [
        f"data.val_files={unscorable_test_split(seven_data, tmp_path)}",
        "trainer.test_freq=2",
        "trainer.save_freq=100",
    ]
    done = train(args, check=False)
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "rewards could not be computed" in error[0], done.stderr[-3000:]
    assert "(step 2)" in error[0] and error[0].endswith("global_step_2")
    assert [m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m] == [1, 2]
    assert load_train_state(tmp_path / "ckpt" / "global_step_2").step == 2


def test_a_step_where_some_rewards_cannot_be_computed_trains_and_logs_their_share(
    tiny_model,  # noqa: F811
    seven_data,  # noqa: F811
    tmp_path,
):
    """Below reward_model.max_error_fraction the run goes on, and the share is in every step's row: 8
    prompts, 4 of them from a data_source no scorer knows; a batch of all 8 x 2 samples has 8 errors."""
    rows = pd.read_parquet(seven_data / "parquet/train.parquet").head(8).copy()
    rows.loc[rows.index[:4], "data_source"] = "no-such-benchmark"
    (tmp_path / "data" / "parquet").mkdir(parents=True)
    rows.to_parquet(tmp_path / "data" / "parquet/train.parquet")
    args = local_args(tiny_model, tmp_path / "data", tmp_path) + [
        "data.train_batch_size=8",  # the whole file every step: 4 known and 4 unknown prompts
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "reward_model.max_error_fraction=0.9",
    ]
    train(args)
    steps = [m for m in metrics_of(tmp_path) if "reward/error_fraction" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for metrics in steps:
        assert metrics["reward/errors"] == 8  # 4 prompts x 2 samples
        assert metrics["reward/error_fraction"] == pytest.approx(0.5, abs=1e-6)  # 8 of 16


FAILS_IN_VALIDATION = """
import os

from services.common.client import ServiceError


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the training split scores as gsm8k's flexible method would here; the test split fails as a
    # reward-server whose retries ran out does, while FAIL_VALIDATION is set
    if extra_info["split"] == "test" and os.environ.get("FAIL_VALIDATION"):
        raise ServiceError("reward-server unreachable (test double)")
    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0
"""


def test_a_service_failure_in_validation_keeps_the_step_it_validates(tiny_model, seven_data, tmp_path):  # noqa: F811
    """Step 2's update is done when its validation's scorer fails: the run stops saving it as step 2 (its
    weights, its row, the cursor after it), not as step 1 with step 2's weights (a resumed run would then
    train step 2's batch twice). A resumed run goes on at step 3 as an uninterrupted run does."""
    scorer = tmp_path / "fails_in_validation.py"
    scorer.write_text(FAILS_IN_VALIDATION)

    def args(workdir: Path, *extra: str) -> list[str]:
        return common_args(tiny_model, workdir, 3) + [
            f"data.train_files={seven_data / 'parquet/train.parquet'}",
            f"data.val_files={seven_data / 'parquet/test.parquet'}",
            "reward_model.mode=local",
            f"custom_reward_function.path={scorer}",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "data.max_response_length=4",
            *extra,
        ]

    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    # validation at step 2 (and the last); save_freq past the run: the only checkpoint is the one the
    # failure writes
    validating = ["trainer.test_freq=2", "trainer.save_freq=100"]
    failed = train(args(stopped, *validating), env={"FAIL_VALIDATION": "1"}, check=False)
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "stayed unreachable at step 2" in error[0], failed.stderr[-3000:]
    assert error[0].endswith("global_step_2")
    assert not (stopped / "ckpt" / "global_step_1").exists()
    assert [m["step"] for m in metrics_of(stopped) if "actor/pg_loss" in m] == [1, 2]

    train(args(straight, "trainer.test_freq=-1", "trainer.save_freq=1"))
    assert same_weights(straight / "ckpt/global_step_2", stopped / "ckpt/global_step_2")  # step 2's update
    assert load_train_state(stopped / "ckpt/global_step_2").step == 2
    cursors = [load_train_state(run / "ckpt/global_step_2").data_cursor for run in (straight, stopped)]
    assert cursors[0] == cursors[1]  # after step 2's batch
    rngs = [
        torch.load(run / "ckpt/global_step_2" / RNG_FILE, weights_only=True) for run in (straight, stopped)
    ]
    assert torch.equal(rngs[0]["torch_cpu"], rngs[1]["torch_cpu"])

    resumed = train(args(stopped, *validating, "trainer.resume_mode=auto"))
    assert "resumed from" in resumed.stdout and "global_step_2 (step 2)" in resumed.stdout
    assert [m["step"] for m in metrics_of(stopped) if "actor/pg_loss" in m] == [1, 2, 3]
    assert same_weights(straight / "ckpt/global_step_3", stopped / "ckpt/global_step_3")


def same_weights(a: Path, b: Path) -> bool:
    left, right = load_role_weights(a / "actor"), load_role_weights(b / "actor")
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def test_checkpoint_save_contents_model_and_hf_model(tiny_model, seven_data, tmp_path):  # noqa: F811
    """actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]: each checkpoint holds the
    sharded weights and a transformers folder that loads on its own, no optimizer state; a resume reads
    the weights (its AdamW restarts, said at start), and asking for the optimizer stops in one line."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    contents = "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"
    args = local_args(tiny_model, seven_data, tmp_path) + [contents, "trainer.save_freq=1"]
    train(args + ["trainer.total_training_steps=1"])
    actor = tmp_path / "ckpt" / "global_step_1" / "actor"
    stored = FileSystemReader(str(actor)).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in stored} == {"model"} and not (actor / "scheduler.pt").exists()
    hf = AutoModelForCausalLM.from_pretrained(actor / "huggingface")
    trained = load_role_weights(actor)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, trained[name]), name  # fp32 on the CPU: the very weights
    assert set(load_file(actor / "huggingface" / "model.safetensors")) >= set(stored_names(stored))

    resumed = train(args + ["trainer.total_training_steps=2"])
    assert "global_step_1 (step 1)" in resumed.stdout
    assert "leaves out the optimizer: a resume restarts AdamW's moments" in resumed.stdout
    assert [m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m] == [1, 2]

    asking = "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]"
    refused = train(args + ["trainer.total_training_steps=3", asking], check=False)
    assert refused.returncode == 1, refused.stderr[-3000:]
    error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert error[0].endswith("actor_rollout_ref.actor.checkpoint.load_contents=['model']")
    assert not (tmp_path / "ckpt" / "global_step_3").exists()


def stored_names(metadata) -> list[str]:
    return [key.removeprefix("model.") for key in metadata if key.startswith("model.")]
