"""torch.profiler over chosen training steps (trainer.profile_steps), in the driver and in every Ray rank."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def profiled(log_dir: str, step: int, steps: Sequence[int] | None, groups: Sequence = ()) -> Iterator[None]:
    """torch.profiler around one training step when `step` is in `steps` (trainer.profile_steps):
    log_dir/profile/step_N.txt, the ops with the most self CPU and (on a GPU) device time, and
    step_N.json, a Chrome trace (ui.perfetto.dev): kernels, host syncs, allocator calls, Python.
    `groups` (Ray role groups) profile their ranks over the same step: step_N_<role>_rank<R>.txt/.json
    in log_dir/profile on each rank's node. A step that raises is written too (its profile is the one
    worth reading), and its error is the one that propagates."""
    if not steps or step not in steps:
        yield
        return
    folder, name = Path(log_dir) / "profile", f"step_{step}"
    prof, ran, started = new_profiler(), False, []
    try:
        for group in groups:
            group.start_profile()
            started.append(group)
        with prof:
            ran = True
            yield
    finally:
        failing = sys.exc_info()[1] is not None
        for group in started:
            try:
                group.stop_profile(str(folder), f"{name}_{group.role_name}")
            except Exception:
                if not failing:  # ranks that died in the failed step cannot answer: keep its error
                    raise
        if ran:
            write_profile(prof, folder, name)


def new_profiler():
    """torch.profiler over the CPU (and CUDA) activity of every thread, where this torch can. A rank
    generates on its engine's thread and hands rollouts over on its replica's; profiled from the calling
    thread only (torch's default), a one-GPU step's trace showed ~150 ms around generation with no op at
    all (BENCHMARKS.md, 2026-12-02)."""
    from torch.profiler import profile

    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the calling thread only
        return profile(activities=profiler_activities())
    return profile(activities=profiler_activities(), experimental_config=config)


def profiler_activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()


def write_profile(prof, folder: Path, name: str) -> None:
    """name.txt (top ops by self CPU time, and by device time on a GPU) and name.json (Chrome trace)."""
    folder.mkdir(parents=True, exist_ok=True)
    sorts = ["self_cpu_time_total"] + ["self_device_time_total"] * torch.cuda.is_available()
    tables = [prof.key_averages().table(sort_by=key, row_limit=40) for key in sorts]
    (folder / f"{name}.txt").write_text("\n\n".join(tables))
    prof.export_chrome_trace(str(folder / f"{name}.json"))
