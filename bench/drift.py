"""A re-measurement of the headline GPU figures against bench/headline.json: each figure, the value held,
the value now, the change, and a flag where it moved more than 10% (either way: a gain that large should be
understood before it is quoted, too). bench/gpu_check.sh runs the benchmarks and then this.

    python bench/drift.py --results DIR [--card H100|H200] [--threshold 0.10]

DIR holds what the benchmarks wrote: scaling/results.json (bench/scaling.py --results DIR/scaling),
step_vs_trl/summary.json (bench/step_vs_trl.py --out DIR/step_vs_trl) and rollout.json (bench/rollout.py
--json DIR/rollout.json); any of them may be missing. The card is read from the step and rollout results
(torch's device name) unless given. Exit status 1 when a figure drifted, 2 when nothing was comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADLINE = Path(__file__).resolve().with_name("headline.json")
LOWER_IS_BETTER = ("step_s", "timing_s/")


def measured(results: Path) -> tuple[dict[str, dict], str | None]:
    """{benchmark: {figure or case: value or {metric: value}}} from the files in `results`, and the card
    name the results report (None if none does)."""
    out: dict[str, dict] = {}
    device = None
    scaling = results / "scaling" / "results.json"
    if scaling.exists():
        out["scaling"] = {r["case"]: r for r in json.loads(scaling.read_text()) if r.get("status") == "done"}
    step = results / "step_vs_trl" / "summary.json"
    if step.exists():
        summary = json.loads(step.read_text())
        device = summary.get("device")
        ours, trl = summary["ours"], summary["trl"]
        out["step_vs_trl"] = {
            "ours_step_s": ours["mean_step_s"],
            "ours_tokens_per_s_per_gpu": ours["tokens_per_s_per_gpu"],
            "ours_mfu_actor": ours.get("mean perf/mfu/actor"),
            "trl_step_s": trl["mean_step_s"],
            "ours_over_trl": summary["ours_over_trl"],
        }
    rollout = results / "rollout.json"
    if rollout.exists():
        result = json.loads(rollout.read_text())
        device = device or result.get("device")
        out["rollout"] = {f"batch {row['batch']}": row for row in result["rows"]}
    return out, device


def card_of(device: str | None) -> str | None:
    for card in ("H100", "H200"):
        if device and card in device:
            return card
    return None


def compare(held: dict, now: dict, threshold: float) -> list[tuple[str, float, float | None, str]]:
    """(figure, held, now, verdict) for every figure the headline holds for this card."""
    rows = []
    for bench, entry in held.items():
        for name, value in entry["figures"].items():
            pairs = value.items() if isinstance(value, dict) else [(None, value)]
            for metric, old in pairs:
                found = now.get(bench, {}).get(name)
                new = found.get(metric) if isinstance(found, dict) and metric else found
                label = f"{bench}: {name}" + (f" {metric}" if metric else "")
                if new is None:
                    rows.append((label, old, None, "not measured"))
                    continue
                change = new / old - 1
                lower_better = any(key in (metric or name) for key in LOWER_IS_BETTER)
                worse = change > 0 if lower_better else change < 0
                verdict = f"{change:+.1%}"
                if abs(change) > threshold:
                    verdict += "  DRIFT (" + ("worse" if worse else "better") + ")"
                rows.append((label, old, new, verdict))
    return rows


def number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--card", choices=["H100", "H200"], default=None)
    parser.add_argument("--threshold", type=float, default=0.10)
    args = parser.parse_args(argv)
    now, device = measured(args.results)
    card = args.card or card_of(device)
    headline = json.loads(HEADLINE.read_text())
    if card not in headline:
        print(f"no headline figures for card {card!r} (device {device!r}): pass --card", file=sys.stderr)
        return 2
    rows = compare(headline[card], now, args.threshold)
    print(f"{card} ({device or 'card given'}): re-measured against bench/headline.json")
    for label, old, new, verdict in rows:
        print(f"  {label:<42}{number(old):>12}{number(new):>12}  {verdict}")
    if all(new is None for _, _, new, _ in rows):
        return 2
    return 1 if any("DRIFT" in verdict for *_, verdict in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
