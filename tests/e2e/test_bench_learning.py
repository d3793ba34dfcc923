"""bench/learning.py and bench/step_vs_trl.py: their bookkeeping, and both end to end in --smoke mode
(CPU, tiny models, a GSM8K-format fixture), so a GPU run does not fail on plumbing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.data_server.synthetic import make_problem
from tests.helpers import ROOT


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


learning = load_bench("learning")


@pytest.fixture(scope="module")
def gsm8k_fixture(tmp_path_factory) -> Path:
    """GSM8K-format question/answer rows (the synthetic generator writes GSM8K's answer style)."""
    folder = tmp_path_factory.mktemp("gsm8k")
    for split, size in (("train", 12), ("test", 4)):
        lines = []
        for index in range(size):
            problem = make_problem(0, split, index, "easy")
            lines.append(json.dumps({"question": problem.question, "answer": problem.answer}))
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_trl_batching_matches_the_recipe():
    recipe = learning.load_recipe(learning.RECIPE, [])
    s = learning.shared_settings(recipe)
    # recipe: 64 prompts x n=8 = 512 completions a step, mini-batches of 32 prompts (256 completions)
    # in micro-batches of 64 -> 4 accumulation steps per optimizer step, 8 micro-batches per generation.
    assert (s.prompts_per_step, s.n, s.mini_batch_prompts, s.micro_batch) == (64, 8, 32, 64)
    assert learning.trl_batching(s) == {
        "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 4,
        "steps_per_generation": 8,
        "num_generations": 8,
    }
    odd = learning.shared_settings(learning.load_recipe(learning.RECIPE, ["data.train_batch_size=36"]))
    with pytest.raises(ValueError, match="micro-batch"):
        learning.trl_batching(odd)  # 36 * 8 = 288 completions do not split into micro-batches of 64


def test_overrides_reach_nested_keys():
    recipe = learning.load_recipe(
        learning.RECIPE, ["actor_rollout_ref.actor.optim.lr=3e-5", "data.x.y=[1,2]"]
    )
    assert recipe["actor_rollout_ref"]["actor"]["optim"]["lr"] == 3e-5
    assert recipe["data"]["x"]["y"] == [1, 2]


def test_curve_keeps_the_latest_checkpoint_before_each_mark():
    clocks = {5: 40.0, 10: 85.0, 15: 120.0, 20: 170.0, 25: 210.0}
    marks = learning.marks(200.0, 2)  # [100, 200]
    assert marks == [100.0, 200.0]
    assert learning.curve_points(clocks, marks) == [10, 20]
    # While training: also the newest (25 may not be final yet); 5 and 15 can go.
    assert learning.keep_latest_per_mark(clocks, marks) == {10, 20, 25}
    assert learning.curve_points({5: 150.0, 10: 260.0}, marks) == [5]  # the first mark had none: skipped
    assert learning.curve_points({10: 260.0, 15: 300.0}, marks) == [10]  # none before any: the earliest
    assert learning.keep_latest_per_mark({}, marks) == set()


@pytest.mark.slow
def test_learning_smoke_end_to_end(tmp_path, gsm8k_fixture):
    out = tmp_path / "learning"
    command = [sys.executable, "bench/learning.py", "all", "--smoke", "--budget-s", "1.5", "--points", "2"]
    command += ["--gsm8k", str(gsm8k_fixture), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["base"]["n"] == 4
    for arm in ("ours", "trl"):
        points = summary[arm]["points"]
        assert 1 <= len(points) <= 2
        assert all(p["n"] == 4 and 0 <= p["accuracy"] <= 1 for p in points)
        assert [p["clock_s"] for p in points] == sorted(p["clock_s"] for p in points)
        assert summary[arm]["steps_logged"] >= 1
    assert (out / "accuracy.png").stat().st_size > 10_000
    assert not (out / "ours" / "checkpoints").exists()  # exported and removed after evaluation


@pytest.mark.slow
def test_step_vs_trl_smoke_end_to_end(tmp_path, gsm8k_fixture):
    out = tmp_path / "step"
    command = [
        sys.executable,
        "bench/step_vs_trl.py",
        "--smoke",
        "--gsm8k",
        str(gsm8k_fixture),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for arm in ("ours", "trl"):
        assert len(summary[arm]["steps"]) == 2
        # 2 prompts x n=2 x exactly 8 response tokens, plus the prompts' tokens
        assert summary[arm]["mean_tokens"] > 2 * 2 * 8
        assert summary[arm]["tokens_per_s_per_gpu"] > 0
    assert summary["ours_over_trl"] > 0
