"""The trainer end to end on CPU, through real data-server and reward-server processes.

- learning: GRPO on a tiny random Qwen2 (char vocabulary) rises clearly on a reward it can learn;
- resume: 4 steps straight == 2 steps, stop, resume, 2 steps (bit-identical parameters);
- kill: SIGKILL once a checkpoint is on disk, resume to the end -> every step and checkpoint has its row;
- outage: the reward-server killed and restarted mid-run -> the run goes on, no batch lost or repeated;
  killed for good -> a clear error and a usable last checkpoint;
- verl's two seed commands run as written (small model and sizes substituted);
- the KL penalty in the reward with an exactly on-policy update (one mini-batch, one epoch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.data_server.export import write_verl_parquet
from services.data_server.sources import gsm8k_row
from tests.helpers import ROOT, free_port, service_process, stop_process, wait_healthy
from tests.trainer.test_config import GRPO_QWEN3, PPO_QUICKSTART, argv_of, small
from trainer.checkpoint import load_role_weights, load_train_state
from testing.tiny import make_tiny_model

# Every answer is 7: a policy that ends its response with the digit 7 scores 1 (gsm8k, flexible).
# A random char-level model does so ~3% of the time, so GRPO has a signal from the first step.
SEVEN_ROWS = [{"question": f"Question {i}: say the number.", "answer": "#### 7"} for i in range(64)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(folder, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, tokenizer="char")
    return folder


@pytest.fixture(scope="module")
def seven_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("seven")
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in SEVEN_ROWS) + "\n")
    (folder / "test.jsonl").write_text("\n".join(json.dumps(r) for r in SEVEN_ROWS[:8]) + "\n")
    for split in ("train", "test"):
        rows = [gsm8k_row(r["question"], r["answer"], split, i) for i, r in enumerate(SEVEN_ROWS)]
        write_verl_parquet(rows, folder / "parquet" / f"{split}.parquet")
    return folder


@pytest.fixture(scope="module")
def data_server(seven_data):
    with service_process(
        "services.data_server", "--datasets", f"seven={seven_data}", "--log-level", "warning"
    ) as (url, _):
        yield url


def start_reward_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.reward_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(f"http://127.0.0.1:{port}", 120, proc)
    return proc


def common_args(model: Path, workdir: Path, steps: int) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=8",
        "data.max_prompt_length=160",
        "data.max_response_length=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        "actor_rollout_ref.rollout.n=8",
        "reward_model.gsm8k_method=flexible",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.log_dir={workdir / 'run'}",
        f"trainer.rollout_data_dir={workdir / 'rollouts'}",
    ]


def train(args: list[str], *, timeout: float = 600, env: dict | None = None, check: bool = True):
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main_ppo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics_of(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]


def trained_uids(workdir: Path, steps: int) -> list[str]:
    uids = []
    for step in range(1, steps + 1):
        rows = [
            json.loads(line) for line in (workdir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        ]
        uids += list(dict.fromkeys(row["uid"] for row in rows))  # n rows per prompt, in order
    return uids


def served_uids(url: str, batches: int, batch_size: int = 8) -> list[str]:
    """What the data-server hands out, walking its cursor from the start."""
    uids, cursor = [], None
    for _ in range(batches):
        body = httpx.post(
            url + "/v1/batches", json={"dataset": "seven", "batch_size": batch_size, "cursor": cursor}
        ).json()
        uids += [item["uid"] for item in body["items"]]
        cursor = body["next_cursor"]
    return uids


def served_cursor(url: str, batches: int, batch_size: int = 8) -> str:
    cursor = None
    for _ in range(batches):
        cursor = httpx.post(
            url + "/v1/batches", json={"dataset": "seven", "batch_size": batch_size, "cursor": cursor}
        ).json()["next_cursor"]
    return cursor


def test_grpo_learns_through_real_services(tiny_model, data_server, tmp_path):
    port = free_port()
    reward = start_reward_server(port)
    try:
        train(
            common_args(tiny_model, tmp_path, 30) + server_args(data_server, port) + ["trainer.save_freq=-1"]
        )
    finally:
        stop_process(reward)
    scores = [m["critic/score/mean"] for m in metrics_of(tmp_path) if "critic/score/mean" in m]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert len(scores) == 30
    assert first < 0.2 and last > first + 0.3, scores
    assert trained_uids(tmp_path, 30) == served_uids(data_server, 30)  # every batch, in order, once


def test_resume_gives_identical_parameters(tiny_model, seven_data, tmp_path):
    files = [
        f"data.train_files={seven_data / 'parquet/train.parquet'}",
        "reward_model.mode=local",
        "trainer.save_freq=2",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(common_args(tiny_model, straight, 4) + files)
    train(common_args(tiny_model, split, 2) + files)
    assert not (split / "ckpt" / "global_step_4").exists()
    resumed = train(common_args(tiny_model, split, 4) + files)
    assert "resumed from" in resumed.stdout and "global_step_2" in resumed.stdout
    a = load_role_weights(straight / "ckpt/global_step_4/actor")
    b = load_role_weights(split / "ckpt/global_step_4/actor")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    # the data cursor and the tracker's run id travelled with the checkpoint
    assert (
        load_train_state(split / "ckpt/global_step_4").data_cursor
        == load_train_state(straight / "ckpt/global_step_4").data_cursor
    )
    assert len({m.get("step") for m in metrics_of(split)}) == 4


def test_kl_in_reward_with_an_exactly_on_policy_update_runs(tiny_model, seven_data, tmp_path):
    # One mini-batch and one epoch: the update may skip the old-logprob pass, but the KL penalty in the
    # reward is taken against those logprobs, so the step must compute them (this crashed at step 1).
    train(
        common_args(tiny_model, tmp_path, 2)
        + [
            f"data.train_files={seven_data / 'parquet/train.parquet'}",
            "reward_model.mode=local",
            "trainer.save_freq=-1",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=1",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=abs",  # |log pi - log pi_ref|: no cancelling of signs, as k1 has
            "algorithm.kl_ctrl.kl_coef=0.1",
            "trainer.profile_steps=[2]",  # and verl's profiler key: step 2 under torch.profiler
            "actor_rollout_ref.actor.use_dynamic_bsz=true",  # and token-budget micro-batches everywhere
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
        ]
    )
    profiles = tmp_path / "run" / "profile"
    assert sorted(p.name for p in profiles.iterdir()) == ["step_2.json", "step_2.txt"]
    assert "Self CPU" in (profiles / "step_2.txt").read_text()
    # the local rank's calls are named phases as a Ray rank's are, so bench/trace_summary.py splits them
    trace = (profiles / "step_2.json").read_text()
    assert all(f'"rank.{phase}"' in trace for phase in ("compute_logprobs", "update"))
    steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("timing_s/old_log_prob" in m and "timing_s/ref" in m for m in steps)
    # step 1: the policy is still the reference, and the old logprobs are computed exactly as the
    # reference's, so the penalty is 0 (step 2's depends on how far the first update moved)
    assert steps[0]["actor/reward_kl_penalty"] < 1e-6
    assert all(m["actor/reward_kl_penalty_coeff"] == 0.1 for m in steps)


@pytest.mark.gpu
def test_a_one_process_run_trains_on_a_gpu_with_the_built_in_engine(tiny_model, seven_data, tmp_path):
    """The one-process path on CUDA, start to end: `trainer.device=cuda` (a bare "cuda", which
    torch.cuda.set_device refused until resolve_device gave it this process's index; issue 29's first
    GPU run died there) with the built-in engine's Triton kernels and CUDA graphs."""
    args = [a for a in common_args(tiny_model, tmp_path, 2) if a != "trainer.device=cpu"]
    train(
        args
        + [
            "trainer.device=cuda",
            f"data.train_files={seven_data / 'parquet/train.parquet'}",
            "reward_model.mode=local",
            "trainer.save_freq=-1",
            "actor_rollout_ref.rollout.name=builtin",
        ]
    )
    steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in steps)


def server_args(data_url: str, reward_port: int) -> list[str]:
    return [
        "data.source=server",
        "data.dataset=seven",
        f"services.data_url={data_url}",
        f"services.reward_url=http://127.0.0.1:{reward_port}",
        "reward_model.mode=server",
    ]


def start_trainer(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.main_ppo", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(workdir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    path = workdir / "run" / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if path.exists() and any(
            json.loads(line).get("step") == step for line in path.read_text().splitlines() if line
        ):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} never logged")


def test_reward_server_restart_mid_run_loses_nothing(tiny_model, data_server, tmp_path):
    port = free_port()
    reward = start_reward_server(port)
    trainer = start_trainer(
        common_args(tiny_model, tmp_path, 6)
        + server_args(data_server, port)
        + ["trainer.save_freq=-1"]  # the default retries: services.retry_deadline_s waits out a restart
    )
    try:
        wait_for_step(tmp_path, 2, trainer)
        reward.send_signal(signal.SIGKILL)
        reward.wait()
        time.sleep(20.0)  # a job group's service takes tens of seconds to come back
        reward = start_reward_server(port)
        assert trainer.wait(timeout=300) == 0, trainer.stderr.read()[-3000:]
    finally:
        stop_process(trainer)
        stop_process(reward)
    assert [m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m] == [1, 2, 3, 4, 5, 6]
    assert trained_uids(tmp_path, 6) == served_uids(data_server, 6)


def test_reward_server_gone_for_good_ends_with_clear_error_and_checkpoint(tiny_model, data_server, tmp_path):
    port = free_port()
    reward = start_reward_server(port)
    trainer = start_trainer(
        common_args(tiny_model, tmp_path, 50)
        + server_args(data_server, port)
        + ["services.retries=2", "services.retry_deadline_s=0", "trainer.save_freq=2"]
    )
    try:
        wait_for_step(tmp_path, 3, trainer)
        stop_process(reward)
        code = trainer.wait(timeout=300)
        stderr = trainer.stderr.read()
    finally:
        stop_process(trainer)
    assert code == 1
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "stayed unreachable" in error[0] and "Traceback" not in stderr
    path = Path(error[0].rsplit("last usable checkpoint: ", 1)[1])
    state = load_train_state(path)
    assert state.step >= 3  # the steps completed before the outage are kept
    # ... with the cursor right after them: a resumed run trains next on the batch the failed step fetched
    assert state.data_cursor == served_cursor(data_server, state.step)


def test_a_run_an_outage_stopped_resumes_as_if_never_stopped(tiny_model, data_server, tmp_path):
    """save_freq > 1 and the reward-server gone at some step k: the checkpoint written as the run stops is
    step k-1 with the data cursor AND the random streams from before step k, so the resumed run samples
    what an uninterrupted run samples: the weights after step k+1 are bit-identical."""
    small = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    small += ["actor_rollout_ref.rollout.n=4", "data.max_response_length=4"]
    # save_freq past the run: the only checkpoint before the end is the one written as the run stops
    args = small + ["services.retries=1", "services.retry_deadline_s=0", "trainer.save_freq=100"]
    port = free_port()
    reward = start_reward_server(port)
    stopped = tmp_path / "stopped"
    trainer = start_trainer(common_args(tiny_model, stopped, 50) + server_args(data_server, port) + args)
    try:
        wait_for_step(stopped, 3, trainer)
        stop_process(reward)
        assert trainer.wait(timeout=300) == 1
        error = [line for line in trainer.stderr.read().splitlines() if line.startswith("error:")]
        last = load_train_state(Path(error[0].rsplit("last usable checkpoint: ", 1)[1])).step
        assert last >= 3
        reward = start_reward_server(port)
        resumed = train(common_args(tiny_model, stopped, last + 1) + server_args(data_server, port) + args)
        assert f"global_step_{last}" in resumed.stdout
        straight = tmp_path / "straight"
        train(common_args(tiny_model, straight, last + 1) + server_args(data_server, port) + args)
    finally:
        stop_process(trainer)
        stop_process(reward)
    a = load_role_weights(straight / f"ckpt/global_step_{last + 1}/actor")
    b = load_role_weights(stopped / f"ckpt/global_step_{last + 1}/actor")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_a_step_whose_checkpoint_cannot_be_written_keeps_its_metrics_row(tiny_model, seven_data, tmp_path):
    """The loop logs a step before it checkpoints it: a save that fails (here: the folder made immutable
    after step 1) or a kill between the two never leaves a checkpointed step without its row."""
    from tests.trainer.test_checkpoint import _make_unwritable, _restore_writable

    args = common_args(tiny_model, tmp_path, 3) + [
        f"data.train_files={seven_data / 'parquet/train.parquet'}",
        "reward_model.mode=local",
        "trainer.save_freq=1",
    ]
    trainer = start_trainer(args)
    root = tmp_path / "ckpt"
    try:
        deadline = time.monotonic() + 300
        while not (root / "latest_checkpointed_iteration.txt").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.05)
        if not _make_unwritable(root):
            pytest.skip("cannot make a folder unwritable here (root without chattr)")
        code = trainer.wait(timeout=300)
        stderr = trainer.stderr.read()
    finally:
        _restore_writable(root)
        stop_process(trainer)
    assert code == 1
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "global_step_2" in error[0] and "global_step_1" in error[0], stderr[-2000:]
    assert [m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m] == [1, 2]


def test_a_run_killed_after_a_checkpoint_resumes_with_every_step_logged(tiny_model, seven_data, tmp_path):
    """SIGKILL as soon as global_step_2 is on disk (wherever step 3 then is), resume to the end: every step
    has its metrics row, and every checkpoint written, before the kill or after it, has its step's row."""
    steps = 4
    args = common_args(tiny_model, tmp_path, steps) + [
        f"data.train_files={seven_data / 'parquet/train.parquet'}",
        "reward_model.mode=local",
        "trainer.save_freq=1",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=2",
    ]
    root = tmp_path / "ckpt"
    trainer = start_trainer(args)
    try:
        deadline = time.monotonic() + 300
        while not (root / "global_step_2").exists():  # renamed into place complete: never a partial one
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.02)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    finally:
        stop_process(trainer)
    saved = {int(path.name.removeprefix("global_step_")) for path in root.glob("global_step_*")}
    assert 2 in saved and steps not in saved  # killed mid-run
    # each step saved before the kill already has its row (the row is written first)
    assert saved <= {m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m}
    resumed = train(args + ["trainer.resume_mode=auto"])
    assert "resumed from" in resumed.stdout
    logged = {m["step"] for m in metrics_of(tmp_path) if "actor/pg_loss" in m}
    assert logged == set(range(1, steps + 1))


@pytest.fixture
def verl_home(tmp_path, tiny_model, seven_data):
    """$HOME with ~/data/gsm8k/{train,test}.parquet and ~/models/tiny, as the seed commands expect."""
    for split in ("train", "test"):
        target = tmp_path / "data" / "gsm8k" / f"{split}.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((seven_data / "parquet" / f"{split}.parquet").read_bytes())
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model)
    return tmp_path


@pytest.mark.parametrize("command", [PPO_QUICKSTART, GRPO_QWEN3], ids=["ppo-quickstart", "grpo-qwen3"])
def test_seed_commands_run_as_written(verl_home, command, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(verl_home))
    env = {
        "HOME": str(verl_home),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "PYTHONUNBUFFERED": "1",
    }
    # The PPO quickstart runs as verl's users run it, with no reward-server: scored in-process. The GRPO
    # command runs as the job group does, with REWARD_SERVER_URL set: scored by the reward-server.
    reward = None
    if command is GRPO_QWEN3:
        port = free_port()
        reward = start_reward_server(port)
        env["REWARD_SERVER_URL"] = f"http://127.0.0.1:{port}"
    base = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_URL"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trainer.main_ppo", *argv_of(small(command))],
            cwd=verl_home,
            capture_output=True,
            text=True,
            timeout=600,
            env={**base, **env},
        )
    finally:
        if reward is not None:
            stop_process(reward)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"  mode: {'server' if reward else 'local'}" in done.stdout.splitlines()
    assert "step:1 - " in done.stdout
    assert "val-core/openai/gsm8k/acc/mean@1" in done.stdout
    if command is PPO_QUICKSTART:
        assert "critic/vf_loss" in done.stdout  # PPO with a critic
    else:
        assert "actor/kl_loss" in done.stdout  # GRPO with the low_var_kl loss


def test_dapo_dynamic_sampling_trains_only_groups_whose_rewards_vary(tiny_model, seven_data, tmp_path):
    train(
        common_args(tiny_model, tmp_path, 2)
        + [
            f"data.train_files={seven_data / 'parquet/train.parquet'}",
            "reward_model.mode=local",
            "trainer.save_freq=-1",
            "data.train_batch_size=2",
            "data.gen_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=50",
        ]
    )
    steps = [m for m in metrics_of(tmp_path) if "train/num_gen_batches" in m]
    assert len(steps) == 2 and all(m["train/num_gen_batches"] >= 1 for m in steps)
    for step in (1, 2):
        rows = [
            json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        ]
        groups: dict[str, list[float]] = {}
        for row in rows:
            groups.setdefault(row["uid"], []).append(row["score"])
        assert len(groups) == 2 and all(len(scores) == 8 for scores in groups.values())  # full batch, n each
        assert all(len(set(scores)) > 1 for scores in groups.values())  # no zero-variance group trained on
