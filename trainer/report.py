"""Training curves from a run's metrics.jsonl: `python -m trainer.report RUN_DIR [--out FILE.png]`.

Draws a grid of the panels whose metrics the run logged (reward/score, validation accuracy, response
length, policy loss, KL, entropy, grad norm, timing breakdown) and prints a short summary: first, last
and best value of critic/score/mean and of every val-core/*/acc/mean@k. Works while a run is still
writing (a truncated last line is skipped) and after resumes (the last value logged for a step wins).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

# written by trainer.tracking's JSONL sink; not imported from there so that plotting needs no torch
METRICS_FILE = "metrics.jsonl"
Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] sorted by step

# (title, regex over metric names); a panel is drawn only when some metric matches
PANELS = (
    ("score / reward", r"^critic/(score|rewards)/mean$"),
    ("validation accuracy", r"^val-core/.+/acc/mean@\d+$"),
    ("response length", r"^response_length/(mean|max)$"),
    ("policy loss", r"^actor/pg_loss$"),
    ("KL", r"^actor/(kl_loss|ppo_kl)$"),
    ("entropy", r"^actor/entropy$"),
    ("grad norm", r"^(actor|critic)/grad_norm$"),
    ("timing (s)", r"^timing_s/"),
)
SUMMARY_KEYS = r"^(critic/score/mean|val-core/.+/acc/mean@\d+)$"


def load_metrics(metrics_file: Path) -> Series:
    """Every numeric metric of a metrics.jsonl as a step-sorted series; later lines override a step."""
    by_key: dict[str, dict[int, float]] = {}
    skipped = 0
    for line in Path(metrics_file).read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            skipped += 1  # e.g. the half-written last line of a run that is still going
            continue
        for key, value in record.items():
            if (
                key not in ("step", "time")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                by_key.setdefault(key, {})[step] = float(value)
    if skipped:
        print(f"warning: skipped {skipped} unreadable line(s) in {metrics_file}", file=sys.stderr)
    return {key: sorted(points.items()) for key, points in by_key.items()}


def panels_present(series: Series) -> list[tuple[str, list[str]]]:
    """The panels with a metric the run logged, less those where every line is flat (a KL panel in a
    run without a KL term: 0 at every step by construction, a panel that says nothing)."""
    present = []
    for title, pattern in PANELS:
        keys = sorted(key for key in series if re.search(pattern, key))
        if keys and not all(is_flat(series[key]) for key in keys):
            present.append((title, keys))
    return present


def is_flat(points: list[tuple[int, float]]) -> bool:
    """Two or more points, all the same value (one point is a reading, not a flat line)."""
    values = {value for _, value in points}
    return len(points) > 1 and len(values) == 1


def plot(series: Series, out_file: Path, *, title: str = "") -> list[str]:
    """Draw the present panels into a PNG; returns their titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = panels_present(series)
    if not panels:
        raise ValueError(
            "no known metric to plot (expected e.g. critic/score/mean, actor/pg_loss, timing_s/*)"
        )
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    # many-line panels (timing) carry their legend under the axes, where it covers no line
    height = 4.5 if any(len(keys) > 2 for _, keys in panels) else 3.5
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, height * rows), squeeze=False, dpi=100)
    for axis, (panel_title, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = zip(*series[key])
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        axis.set_title(panel_title)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if len(keys) > 2:
            axis.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
        else:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_file)
    plt.close(figure)
    return [panel_title for panel_title, _ in panels]


def summary_lines(series: Series) -> list[str]:
    """First, last and best (the maximum: every summarised metric is higher-is-better) of each."""
    lines = []
    for key in sorted(key for key in series if re.search(SUMMARY_KEYS, key)):
        points = series[key]
        (first_step, first), (last_step, last) = points[0], points[-1]
        best_step, best = max(points, key=lambda point: point[1])
        lines.append(
            f"{key}: first {first:.4f} (step {first_step}), last {last:.4f} (step {last_step}), "
            f"best {best:.4f} (step {best_step})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    metrics_file = args.run_dir / METRICS_FILE
    if not metrics_file.is_file():
        print(f"error: {metrics_file} does not exist (is {args.run_dir} a run directory?)", file=sys.stderr)
        return 2
    series = load_metrics(metrics_file)
    out_file = args.out or args.run_dir / "curves.png"
    try:
        titles = plot(series, out_file, title=str(args.run_dir))
    except ValueError as exc:
        print(f"error: {exc} in {metrics_file}", file=sys.stderr)
        return 2
    steps = sorted({step for points in series.values() for step, _ in points})
    print(f"{len(steps)} logged steps ({steps[0]}..{steps[-1]}), {len(series)} metrics")
    for line in summary_lines(series):
        print(line)
    print(f"wrote {out_file} ({', '.join(titles)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
