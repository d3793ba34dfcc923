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
from services.scoring.gsm8k import score_gsm8k
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
    # in one micro-batch of 256 -> no accumulation, 2 micro-batches (optimizer steps) per generation.
    assert (s.prompts_per_step, s.n, s.mini_batch_prompts, s.micro_batch) == (64, 8, 32, 256)
    assert learning.trl_batching(s) == {
        "per_device_train_batch_size": 256,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,
        "num_generations": 8,
    }
    sixty_four = learning.shared_settings(
        learning.load_recipe(learning.RECIPE, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"])
    )
    assert learning.trl_batching(sixty_four)["gradient_accumulation_steps"] == 4
    odd = learning.shared_settings(
        learning.load_recipe(
            learning.RECIPE,
            ["data.train_batch_size=36", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"],
        )
    )
    with pytest.raises(ValueError, match="micro-batch"):
        learning.trl_batching(odd)  # 36 * 8 = 288 completions do not split into micro-batches of 64


def test_overrides_reach_nested_keys():
    recipe = learning.load_recipe(
        learning.RECIPE, ["actor_rollout_ref.actor.optim.lr=3e-5", "data.x.y=[1,2]"]
    )
    assert recipe["actor_rollout_ref"]["actor"]["optim"]["lr"] == 3e-5
    assert recipe["data"]["x"]["y"] == [1, 2]


def test_points_are_the_latest_checkpoint_before_each_mark():
    clocks = {5: 40.0, 10: 85.0, 15: 120.0, 20: 170.0, 25: 210.0}
    marks = learning.marks(200.0, 2)  # [100, 200]
    assert marks == [100.0, 200.0]
    # 15 (120 s) is past the first mark, so no later step can be its point: 10 (85 s) is, settled.
    assert learning.point_for_mark(clocks, 100.0, finished=False) == (True, 10)
    # 25 (210 s) is complete and past the second mark: settled on 20.
    assert learning.point_for_mark(clocks, 200.0, finished=False) == (True, 20)
    # While the newest checkpoint is still before the mark, a later one may still become its point.
    assert learning.point_for_mark({5: 40.0, 10: 85.0}, 100.0, finished=False) == (False, 10)
    assert learning.point_for_mark({5: 40.0, 10: 85.0}, 100.0, finished=True) == (True, 10)
    assert learning.point_for_mark({5: 150.0}, 100.0, finished=False) == (True, None)  # none before it
    # While training: also the newest (25 may not be final yet); 5 and 15 can go.
    assert learning.keep_latest_per_mark(clocks, marks) == {10, 20, 25}
    assert learning.keep_latest_per_mark(clocks, [200.0]) == {20, 25}  # the first mark's point is out
    assert learning.keep_latest_per_mark({}, marks) == set()


def test_gpu_plan_gives_the_evaluator_its_own_gpu_when_it_can():
    arms = list(learning.ARMS)
    four = learning.gpu_plan(["0", "1", "2", "3"], arms)
    assert four.waves == ((("ours", "0"), ("trl", "1"), ("trl-ours-lr", "2")),)
    assert (four.evaluator_gpu, four.evaluator_alongside) == ("3", True)
    eight = learning.gpu_plan([str(i) for i in range(8)], arms)
    assert eight.waves == four.waves and eight.evaluator_gpu == "3"  # the rest stay free
    two = learning.gpu_plan(["0", "1"], arms)  # waves over both GPUs; the evaluator follows
    assert two.waves == ((("ours", "0"), ("trl", "1")), (("trl-ours-lr", "0"),))
    assert not two.evaluator_alongside
    assert (
        two.describe()
        == "ours on GPU 0, trl on GPU 1 then trl-ours-lr on GPU 0; evaluator after the arms on GPU 0"
    )
    pair = learning.gpu_plan(["0", "1"], ["ours", "trl-ours-lr"])  # the pair on two GPUs: at once
    assert pair.waves == ((("ours", "0"), ("trl-ours-lr", "1")),)
    assert pair.describe().endswith("evaluator after, on the GPU the last arms free first")
    three = learning.gpu_plan(["4", "5", "6"], arms)  # as many GPUs as arms: all at once
    assert three.waves == ((("ours", "4"), ("trl", "5"), ("trl-ours-lr", "6")),)
    assert (three.evaluator_gpu, three.evaluator_alongside) == (None, False)
    one = learning.gpu_plan(["0"], ["ours", "trl"])  # no GPU to spare: evaluation after the arms
    assert one.waves == ((("ours", "0"),), (("trl", "0"),))
    assert not one.evaluator_alongside
    assert learning.gpu_plan([], ["ours"]).describe() == "ours; evaluator after the arms"


def test_published_points_skip_a_line_being_written(tmp_path):
    learning.publish(tmp_path, learning.Point(1, 5, 40.0, "w/step_5"))
    with (tmp_path / "points.jsonl").open("a") as handle:
        handle.write('{"mark": 2, "step": 1')  # the writer is mid-line
    assert learning.published(tmp_path) == [learning.Point(1, 5, 40.0, "w/step_5")]


def test_trl_step_with_a_nan_gradient_is_skipped_and_a_run_of_them_stops_the_arm(tmp_path):
    import torch
    from transformers import TrainerControl, TrainerState

    model = torch.nn.Linear(3, 2)
    clock = learning.step_clock(tmp_path, [100.0])
    state, control = TrainerState(), TrainerControl()

    def step(grad_value: float, *, last_value: float | None = None) -> None:
        """One optimizer step as the Trainer calls the callback: begin, pre-optimizer, end."""
        clock.on_step_begin(None, state, control)
        for param in model.parameters():
            param.grad = torch.full_like(param, grad_value)
        if last_value is not None:  # one entry of the last tensor only
            param.grad.view(-1)[-1] = last_value
        clock.on_pre_optimizer_step(None, state, control, model=model)
        state.global_step += 1
        clock.on_step_end(None, state, control, model=model)

    step(0.5)
    assert all(p.grad is not None for p in model.parameters()) and clock.skipped == []
    step(float("nan"))
    assert all(p.grad is None for p in model.parameters())  # AdamW leaves these weights alone
    assert clock.skipped == [2] and not control.should_training_stop
    # clipping by an infinite norm: the first tensor's gradients read 0, the last tensor's one NaN
    step(0.0, last_value=float("nan"))
    assert clock.skipped == [2, 3]
    step(0.5)
    for _ in range(learning.MAX_SKIPPED_IN_A_ROW):
        step(float("nan"))
    # and the step's end, with marks still to come, leaves it stopped
    assert control.should_training_stop and clock.diverged_at == state.global_step


def test_trl_arms_learning_rates():
    s = learning.shared_settings(learning.load_recipe(learning.RECIPE, []))
    assert learning.arm_lr("trl", s) == 1e-6  # GRPOConfig's documented default (TRL 1.16)
    assert learning.arm_lr("trl-ours-lr", s) == learning.arm_lr("ours", s) == 1e-5  # the recipe's


def test_gsm8k_aims_compare_every_point_after_the_first():
    # marks 1-3; base 1.0%. ours 2.0, 3.5, 4.0%; trl 1.5, 2.0, 3.0%; trl-ours-lr diverged after mark 1
    # (0.5%, carried forward). Marks 2 and 3: ours - base = 2.5 and 3.0 points (>= 2), ours above the
    # better TRL arm (trl: 2.0 < 3.5, 3.0 < 4.0). Mark 1 is not judged (ours 2.0 > 1.5 anyway).
    points = {
        "ours": [
            {"mark": 1, "accuracy": 0.02},
            {"mark": 2, "accuracy": 0.035},
            {"mark": 3, "accuracy": 0.04},
        ],
        "trl": [{"mark": 1, "accuracy": 0.015}, {"mark": 2, "accuracy": 0.02}, {"mark": 3, "accuracy": 0.03}],
        "trl-ours-lr": [{"mark": 1, "accuracy": 0.005}],
    }
    by_mark = {arm: learning.accuracy_by_mark(p, 3) for arm, p in points.items()}
    assert by_mark["trl-ours-lr"] == [0.005, 0.005, 0.005]
    aims = learning.gsm8k_aims(0.01, by_mark)
    assert aims["ours_at_least_base_plus_2_points_after_the_first"] is True
    assert aims["ours_above_best_trl_after_the_first"] is True
    assert [(r["mark"], r["best_trl_arm"]) for r in aims["per_mark"]] == [(2, "trl"), (3, "trl")]
    # ours at mark 3 at 2.9%: 1.9 points over the base (< 2) and below trl's 3.0%: both fail
    by_mark["ours"][2] = 0.029
    aims = learning.gsm8k_aims(0.01, by_mark)
    assert aims["ours_at_least_base_plus_2_points_after_the_first"] is False
    assert aims["ours_above_best_trl_after_the_first"] is False
    # no TRL point at all (both diverged before their first mark): undetermined, not met
    aims = learning.gsm8k_aims(0.01, {"ours": by_mark["ours"], "trl": [None] * 3})
    assert aims["ours_above_best_trl_after_the_first"] is None


def test_synthetic_aims_time_to_trl_final_accuracy():
    # budget 900 s: a third is 300 s. TRL's better arm ends at 30%; ours passes 30% at its 225 s point
    # and ends at 45%, 25 points over a 20% base.
    ours = [
        {"clock_s": 225.0, "accuracy": 0.31},
        {"clock_s": 450.0, "accuracy": 0.40},
        {"clock_s": 890.0, "accuracy": 0.45},
    ]
    trl = [{"clock_s": 450.0, "accuracy": 0.22}, {"clock_s": 880.0, "accuracy": 0.25}]
    trl_lr = [{"clock_s": 880.0, "accuracy": 0.30}]
    aims = learning.synthetic_aims(0.20, 900.0, {"ours": ours, "trl": trl, "trl-ours-lr": trl_lr})
    assert (aims["trl_final_accuracy"], aims["trl_final_arm"]) == (0.30, "trl-ours-lr")
    assert aims["ours_clock_to_trl_final_s"] == 225.0
    assert aims["ours_reaches_trl_final_within_a_third"] is True
    assert aims["ours_final_at_least_base_plus_20_points"] is True
    ours[0]["accuracy"] = 0.29  # now first at 450 s > 300 s; and a 30% base leaves 15 points
    aims = learning.synthetic_aims(0.30, 900.0, {"ours": ours, "trl": trl, "trl-ours-lr": trl_lr})
    assert aims["ours_clock_to_trl_final_s"] == 450.0
    assert aims["ours_reaches_trl_final_within_a_third"] is False
    assert aims["ours_final_at_least_base_plus_20_points"] is False


def test_auto_difficulty_takes_the_hardest_level_with_a_signal():
    found = {"easy": {"pass_at_8": 0.9}, "medium": {"pass_at_8": 0.3}, "hard": {"pass_at_8": 0.02}}
    assert learning.choose_level(found, 8) == "medium"
    found["hard"]["pass_at_8"] = learning.PROBE_MIN_PASS
    assert learning.choose_level(found, 8) == "hard"
    found = {level: {"pass_at_8": 0.0} for level in ("easy", "medium", "hard")}
    assert learning.choose_level(found, 8) == "easy"


def test_synthetic_task_holds_out_its_test_split():
    splits = learning.task_rows("synthetic-arith", Path("unused"), (2048, 512))
    assert len(splits["test"]) == 512 and 0 < len(splits["train"]) <= 2048
    train_questions = {row["extra_info"]["question"] for row in splits["train"]}
    assert not train_questions & {row["extra_info"]["question"] for row in splits["test"]}
    row = splits["test"][0]
    assert row["data_source"] == "synthetic-arith" and "####" in row["prompt"][0]["content"]
    # the worked answer's "#### N" earns 1 under the rule every arm and the evaluator use
    answer = row["extra_info"]["answer"]
    assert score_gsm8k(answer, row["reward_model"]["ground_truth"], "strict").score == 1.0


@pytest.mark.slow
def test_learning_smoke_end_to_end(tmp_path, gsm8k_fixture):
    """Both tasks at once on the CPU: synthetic-arith's three arms and the evaluator side by side,
    started detached and waited for; GSM8K's TRL arm in the foreground, evaluated after it (no spare
    GPU); then the report over both."""
    out, copied = tmp_path / "learning", tmp_path / "OUT"
    bench = [sys.executable, "bench/learning.py"]
    # a budget that step 1 fits under load (a 2-core machine at load 8 took 2 s for it): a mark before
    # the first step ends has no point to score
    smoke = ["--smoke", "--budget-s", "5", "--points", "2", "--out", str(out)]
    auto = ["--difficulty", "auto"]  # the base model probed on each level first
    started = run([*bench, "start", "--task", "synthetic-arith", "--gpus", "0,1,2,3", *auto, *smoke])
    assert "started synthetic-arith" in started
    run([*bench, "all", "--task", "gsm8k", "--arms", "trl", "--gsm8k", str(gsm8k_fixture), *smoke])
    waited = run([*bench, "wait", "240", "--out", str(out), "--copy-to", str(copied)])
    assert "all ended" in waited, waited
    report = run([*bench, "report", "--out", str(out)])
    assert "aim synthetic-arith ours_final_at_least_base_plus_20_points: NOT MET" in report

    arith = json.loads((out / "synthetic-arith" / "summary.json").read_text())
    assert "evaluator alongside on GPU 3" in arith["run"]["plan"]
    assert arith["base"]["n"] == 4
    # a random tiny model solves nothing: no level has a signal, so the easiest is taken
    assert set(arith["probe"]["levels"]) == {"easy", "medium", "hard"} and arith["probe"]["chosen"] == "easy"
    assert all(level["pass_at_2"] == 0 for level in arith["probe"]["levels"].values())
    assert arith["arms"]["trl"]["lr"] == 1e-6 and arith["arms"]["trl-ours-lr"]["lr"] == 1e-5
    for arm in learning.ARMS:
        points = arith["arms"][arm]["points"]
        assert arith["arms"][arm]["state"] == "done"
        assert 1 <= len(points) <= 2
        assert all(p["n"] == 4 and 0 <= p["accuracy"] <= 1 for p in points)
        assert [p["clock_s"] for p in points] == sorted(p["clock_s"] for p in points)
        assert arith["arms"][arm]["steps_logged"] >= 1
        assert not list((out / "synthetic-arith" / arm / "weights").glob("step_*"))  # scored, removed
    assert not (out / "synthetic-arith" / "ours" / "checkpoints").exists()
    gsm8k = json.loads((out / "gsm8k" / "summary.json").read_text())
    assert "evaluator after the arms" in gsm8k["run"]["plan"] and list(gsm8k["arms"]) == ["trl"]
    assert gsm8k["aims"]["ours_above_best_trl_after_the_first"] is None  # no ours arm ran
    assert (out / "accuracy.png").stat().st_size > 10_000
    # what a device call brings back: three files a task, one folder deep
    for task in ("synthetic-arith", "gsm8k"):
        assert sorted(p.name for p in (copied / task).iterdir()) == ["logs.tgz", "logs.txt", "results.json"]
    assert "eval base" in (copied / "synthetic-arith" / "logs.txt").read_text()


def run(command: list[str]) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


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


def test_arm_ab_variants_name_a_tree_and_its_overrides(tmp_path):
    arm_ab = load_bench("arm_ab")
    name, tree, overrides = arm_ab.parse_variant(f"kv={ROOT}:a.b=false:c.d=3")
    assert (name, tree, overrides) == ("kv", ROOT, ["a.b=false", "c.d=3"])
    for bad in (f"={ROOT}", f"x={tmp_path}", "x"):  # no name; a folder without bench/learning.py
        with pytest.raises(SystemExit, match="NAME=TREE"):
            arm_ab.parse_variant(bad)
