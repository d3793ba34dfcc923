"""A/B of our trainer's step on the SmolLM2 learning recipe, several variants in one device call: each
variant runs bench/learning.py's `ours` arm alone on one GPU, in turn (A B C, A B C, ...), and the table
gives the median of each run's steps after the first.

    python bench/arm_ab.py --variant main=. --variant kv=.:actor_rollout_ref.rollout.free_cache_engine=false \
        --variant traced=runs/ab/traced [--rounds 2] [--budget-s 40] [--task synthetic-arith]

A variant is NAME=TREE[:KEY=VALUE...]: TREE is a source tree to run (`.`, or a branch written here with
`mkdir -p runs/ab/X && git archive BRANCH | tar -x -C runs/ab/X` and carried), each KEY=VALUE a recipe
override. Every run reads this checkout's prepared task (`python bench/learning.py prepare --task TASK
...` first, as in its docstring) and rewrites TASK/ours; nothing is checkpointed. A tree's first run
also fills its compile caches, which is why there are rounds: compare the last. Arguments after `--` go
to learning.py (`-- --smoke` runs the plumbing on a CPU). Writes --json with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor")


def parse_variant(text: str) -> tuple[str, Path, list[str]]:
    name, _, spec = text.partition("=")
    tree, *overrides = spec.split(":")
    if not name or not tree or not (Path(tree) / "bench" / "learning.py").exists():
        raise SystemExit(f"--variant {text!r}: want NAME=TREE[:KEY=VALUE...] with TREE/bench/learning.py")
    return name, Path(tree).resolve(), overrides


def run_once(tree: Path, overrides: list[str], args: argparse.Namespace, log: Path) -> dict:
    """One `ours` run of `tree` for the budget; the medians of its steps after the first."""
    command = [sys.executable, str(tree / "bench" / "learning.py"), "ours", "--task", args.task]
    command += ["--out", str(args.out), "--budget-s", str(args.budget_s), "--save-every", "1000000"]
    for override in overrides:
        command += ["--set", override]
    env = dict(os.environ)  # learning.py puts its own tree first on the path, for it and its trainer
    if args.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu
    with log.open("w") as handle:
        proc = subprocess.run(
            command + args.extra, cwd=tree, env=env, stdout=handle, stderr=subprocess.STDOUT
        )
    metrics = args.out / args.task / "ours" / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if metrics.exists()
        else []
    )
    steps = [row for row in rows if "timing_s/step" in row and row["step"] >= 2]
    figures = {"exit": proc.returncode, "steps": len(steps)}
    for field in FIELDS:  # old_log_prob is absent where a step is exactly on-policy
        values = [row[field] for row in steps if field in row]
        figures[field] = statistics.median(values) if values else None
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=TREE[:KEY=VALUE...]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=40.0, help="training clock a run")
    parser.add_argument("--task", default="synthetic-arith")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning", help="learning.py's --out")
    parser.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of every run (none: '')")
    parser.add_argument("--json", type=Path, default=ROOT / "runs" / "arm_ab.json")
    parser.add_argument("extra", nargs="*", help="after --: more learning.py arguments")
    args = parser.parse_args()
    args.out, args.gpu = args.out.resolve(), args.gpu or None
    variants = [parse_variant(text) for text in args.variant]
    logs = args.json.parent / "arm_ab_logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for round_ in range(1, args.rounds + 1):
        for name, tree, overrides in variants:
            figures = run_once(tree, overrides, args, logs / f"{name}_{round_}.log")
            results.append({"round": round_, "variant": name, **figures})
            args.json.write_text(json.dumps(results, indent=1))
            cells = " ".join(
                f"{field.split('/')[-1]} {figures[field]:.3f}" if figures[field] is not None else "-"
                for field in FIELDS
            )
            print(
                f"round {round_} {name:>12}: exit {figures['exit']}, {figures['steps']} steps; {cells}",
                flush=True,
            )


if __name__ == "__main__":
    main()
