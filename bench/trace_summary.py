"""Where a profiled step's time went on each rank, from the Chrome traces `trainer.profile_steps` writes,
and where a driver's time went, from py-spy's samples (`bench/scaling.py --sample-driver`: speedscope,
each thread's samples in time order, 10 ms apart, idle ones included).

    python bench/trace_summary.py <run>/profile/step_3_policy_rank0.json [more traces ...]
    python bench/trace_summary.py <results>/0.5b_x4.driver.json.gz [--within train_step] [--last 20]

For the driver: per thread, the milliseconds whose stack passes through --within (over the last --last
seconds of the thread, e.g. the measured steps), by the innermost trainer/ frames and the frame running.

For every trace: the step's span, and for each phase (the `rank.<method>` ranges a Ray rank's calls are
recorded under, trainer/parallel/placement.py; the time outside them is generation and waiting for the
driver) its wall time, the GPU's busy time in it (the union of kernels, copies and sets), how much of
that was NCCL's kernels (collectives), the GPU's idle time, and the host's CPU-op time per GPU-busy time
(above ~1 the phase launches slower than the GPU runs: host-bound). A rank idle between phases is
waiting for the driver or for another rank. Then every stretch of at least --gap-ms with no GPU work,
with the host ranges and ops that overlapped it most and their threads (a trace, .json or .json.gz).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
from collections import Counter
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def clip(intervals: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    return [(max(a, start), min(b, stop)) for a, b in intervals if b > start and a < stop]


@functools.lru_cache(maxsize=1)  # the phase table and the gaps read the same trace: parse it once
def load(path: Path) -> list[dict]:
    """A Chrome trace's events (plain or gzipped JSON)."""
    events = json.loads(gzip.open(path).read() if path.suffix == ".gz" else path.read_text())
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def summarize(path: Path) -> list[dict]:
    complete = [e for e in load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") in GPU_CATEGORIES]
    nccl = [
        (e["ts"], e["ts"] + e["dur"])
        for e in complete
        if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()
    ]
    cpu_ops = [(e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") == "cpu_op"]
    phases = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in complete
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("rank.")
    )
    everything = gpu + cpu_ops + [(a, b) for a, b, _ in phases]
    if not everything:
        return []
    first, last = min(a for a, _ in everything), max(b for _, b in everything)
    rows = [(first, last, "step (whole trace)")] + phases
    outside, cursor = [], first  # the gaps between phases: generation, the driver, other ranks
    for start, stop, _ in phases:
        if start > cursor:
            outside.append((cursor, start))
        cursor = max(cursor, stop)
    if last > cursor:
        outside.append((cursor, last))
    out = []
    for start, stop, name in rows:
        span = stop - start
        busy = union_us(clip(gpu, start, stop))
        out.append(
            {
                "phase": name,
                "wall_ms": span / 1e3,
                "gpu_busy_ms": busy / 1e3,
                "nccl_ms": union_us(clip(nccl, start, stop)) / 1e3,
                "gpu_idle_ms": (span - busy) / 1e3,
                "cpu_per_gpu": union_us(clip(cpu_ops, start, stop)) / busy if busy else float("nan"),
            }
        )
    busy_out = sum(union_us(clip(gpu, a, b)) for a, b in outside)
    span_out = sum(b - a for a, b in outside)
    out.append(
        {
            "phase": "outside rank.* (generation, waits)",
            "wall_ms": span_out / 1e3,
            "gpu_busy_ms": busy_out / 1e3,
            "nccl_ms": sum(union_us(clip(nccl, a, b)) for a, b in outside) / 1e3,
            "gpu_idle_ms": (span_out - busy_out) / 1e3,
            "cpu_per_gpu": float("nan"),
        }
    )
    return out


def gpu_gaps(path: Path, min_ms: float = 5.0, top: int = 4) -> list[dict]:
    """Every stretch of at least `min_ms` where the GPU ran nothing: when (ms from the trace's first GPU
    work), how long, how much of it some host thread's op or range covered, and the ranges and ops that
    overlapped it most, with their thread's name (the engine's and the replica's threads show where the
    profiler records every thread: trainer/profiling.py)."""
    events = load(path)
    threads = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") in GPU_CATEGORIES)
    host = [e for e in complete if e.get("cat") in ("cpu_op", "user_annotation")]
    if not gpu:
        return []
    gaps, end = [], gpu[0][1]
    for start, stop in gpu[1:]:
        if start - end >= min_ms * 1e3:
            gaps.append((end, start))
        end = max(end, stop)
    out = []
    for start, stop in gaps:
        overlaps = {}
        for e in host:
            seen = min(stop, e["ts"] + e["dur"]) - max(start, e["ts"])
            if seen > 0:
                key = (threads.get((e.get("pid"), e.get("tid"))) or f"tid {e.get('tid')}", e["name"])
                overlaps[key] = max(overlaps.get(key, 0.0), seen)
        covered = union_us(clip([(e["ts"], e["ts"] + e["dur"]) for e in host], start, stop))
        ranked = sorted(overlaps.items(), key=lambda item: -item[1])[:top]
        out.append(
            {
                "at_ms": (start - gpu[0][0]) / 1e3,
                "idle_ms": (stop - start) / 1e3,
                "host_ms": covered / 1e3,
                "overlapping": [(thread, name, ms / 1e3) for (thread, name), ms in ranked],
            }
        )
    return out


def summarize_samples(path: Path, within: str, last_s: float, top: int = 12) -> list[str]:
    """py-spy's speedscope file: per thread, the time of the samples through `within` in its last `last_s`
    seconds (all when 0), by where they were: the innermost trainer/ frames, then the frame running."""
    data = json.loads(gzip.open(path).read() if path.suffix == ".gz" else path.read_text())
    frames = data["shared"]["frames"]
    lines = []
    for thread in data["profiles"]:
        places, clock, start = Counter(), 0.0, thread["endValue"] - last_s if last_s else float("-inf")
        for stack, weight in zip(thread["samples"], thread["weights"]):
            clock += weight
            named = [frames[i] for i in stack]
            if clock < start or (within and not any(within in f["name"] for f in named)):
                continue
            ours = [f"{f['name']}:{f['line']}" for f in named if "/trainer/" in f["file"]][-3:][::-1]
            leaf = (
                f"{named[-1]['name']} ({Path(named[-1]['file']).name}:{named[-1]['line']})" if named else "-"
            )
            places[" < ".join(ours) + " | " + leaf] += weight
        if places:
            lines.append(f"  {thread['name']}: {places.total() * 1e3:.0f} ms")
            lines += [f"    {ms * 1e3:>8.0f} ms  {place}" for place, ms in places.most_common(top)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--within", default="", help="py-spy samples: only stacks through this function")
    parser.add_argument("--last", type=float, default=0.0, help="py-spy samples: a thread's last seconds")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="traces: list GPU idle stretches this long")
    args = parser.parse_args()
    for path in args.traces:
        print(f"\n{path}")
        if path.name.endswith(("driver.json.gz", "driver.json")):  # py-spy's samples
            print("\n".join(summarize_samples(path, args.within, args.last)))
            continue
        print(f"  {'phase':<38}{'wall ms':>10}{'GPU busy':>10}{'NCCL':>9}{'GPU idle':>10}{'CPU/GPU':>9}")
        for row in summarize(path):
            print(
                f"  {row['phase']:<38}{row['wall_ms']:>10.1f}{row['gpu_busy_ms']:>10.1f}"
                f"{row['nccl_ms']:>9.1f}{row['gpu_idle_ms']:>10.1f}{row['cpu_per_gpu']:>9.2f}"
            )
        gaps = gpu_gaps(path, args.gap_ms)
        if gaps:
            print(f"  GPU idle >= {args.gap_ms:g} ms: at ms, idle ms, host-covered ms | what overlapped most")
        for gap in gaps:
            what = "; ".join(f"{thread}: {name[:48]} {ms:.1f}" for thread, name, ms in gap["overlapping"])
            print(f"    {gap['at_ms']:>8.1f} {gap['idle_ms']:>7.1f} {gap['host_ms']:>7.1f} | {what or '-'}")


if __name__ == "__main__":
    main()
