"""What one run uses in all, summed over every process it has, and the guard that stops it past its
limits: the memory and CPU-time limits hold for the whole run, not per process.

Why a watcher and not a cgroup: a per-run cgroup (v2 memory.max, pids.max, cpu.stat) would be the
kernel's own accounting, but the places this service runs cannot be relied on to let it create one:
Docker mounts the cgroup tree read-only in an unprivileged container (compose's service included),
and the development host has a cgroup v2 hierarchy with no controller enabled (every controller is
bound to the legacy v1 hierarchy). So the service measures each run itself, from /proc, every
`SAMPLE_S`, wherever it runs (one mechanism, tested where it is used):

- the run's processes are bubblewrap's init (its `child-pid`, in this service's PID namespace) and
  its descendants, found through /proc/PID/task/TID/children of every thread. The init is the run's
  PID namespace's reaper, so an orphan (a setsid'd, double-forked child) is re-parented to it and
  stays in the tree;
- memory is anonymous and shared-memory pages, each counted once: the sum of /proc/PID/stat's
  resident set is an upper bound read cheaply at every sample (a page shared after fork counts in
  every process), and only when that bound is over the limit is the exact figure read
  (Pss_Anon + Pss_Shmem of /proc/PID/smaps_rollup, which divides a shared page among its sharers);
- CPU time is user + system time of the live processes plus what their reaped children used
  (/proc/PID/stat's utime, stime, cutime, cstime); a child reaped by no one (its parent ignores
  SIGCHLD) drops out of the sum, a gap the per-process RLIMIT_CPU still covers.

Past a limit, the guard stops the run through its `Stopper` (which kills the whole PID namespace). A
run can thus overshoot for up to one sample before it is stopped; the per-process rlimits set by
`prlimit` (RLIMIT_AS, RLIMIT_CPU) stay as the first line, so no single process goes past the limit
even within a sample. The scratch tmpfs mounts are capped by their own size, not by this sum.
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.03
GONE = (FileNotFoundError, ProcessLookupError)  # a process that exited between two reads


class Breach(enum.Enum):
    memory = "memory"
    cpu = "cpu"


@dataclass
class Usage:
    """The most a run held and used, as seen by its guard's samples."""

    peak_memory_bytes: int = 0
    cpu_s: float = 0.0
    samples: int = 0
    breach: Breach | None = None


def run_processes(init_pid: int) -> list[int]:
    """`init_pid` and all its descendants that are alive (zombies included) right now."""
    found, todo = [], [init_pid]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except GONE:
            continue
        found.append(pid)
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as file:
                    todo.extend(int(child) for child in file.read().split())
            except GONE:
                continue
    return found


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 3 first."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except GONE:
        return None
    return text[text.rindex(")") + 2 :].split()


def sample(pids: Iterable[int]) -> tuple[int, float]:
    """(resident bytes summed, an upper bound of the run's memory; CPU seconds, own and reaped)."""
    resident_pages, ticks = 0, 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue
        # fields[0] is stat's field 3 (state): utime..cstime are fields 14-17, rss is field 24
        ticks += sum(int(value) for value in fields[11:15])
        resident_pages += int(fields[21])
    return resident_pages * PAGE_BYTES, ticks / CLOCK_TICKS


def proportional_memory(pids: Iterable[int]) -> int:
    """Anonymous and shared-memory bytes of these processes, a page shared by k of them counted 1/k
    in each (so once in all)."""
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as file:
                for line in file:
                    if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                        total_kb += int(line.split()[1])
        except GONE:
            continue
    return total_kb * 1024


def measure(init_pid: int, memory_limit: int) -> tuple[int, float]:
    """(memory, CPU seconds) of the run under `init_pid`; the memory exact only where the cheap bound
    is over `memory_limit` (below it, the bound is reported: it is what the limit was checked on)."""
    pids = run_processes(init_pid)
    bound, cpu_s = sample(pids)
    if bound <= memory_limit:
        return bound, cpu_s
    return proportional_memory(pids), cpu_s


async def guard(
    init_pid: Callable[[], int | None],
    memory_limit: int,
    cpu_limit_s: float,
    stop: Callable[[], None],
    usage: Usage,
    interval_s: float = SAMPLE_S,
) -> None:
    """Sample the run until it is cancelled (its end) or over a limit: then record which in
    `usage.breach`, call `stop` and return. `init_pid` returns None until the sandbox is up. The
    first sample comes one interval in: most runs are over by then, and cost nothing to guard."""
    while True:
        await asyncio.sleep(interval_s)
        pid = init_pid()
        if pid is None:
            continue
        try:
            memory, cpu_s = measure(pid, memory_limit)
        except Exception:
            stop()  # a run that cannot be measured does not run on unguarded
            raise
        usage.samples += 1
        usage.peak_memory_bytes = max(usage.peak_memory_bytes, memory)
        usage.cpu_s = max(usage.cpu_s, cpu_s)
        if memory > memory_limit or cpu_s > cpu_limit_s:
            usage.breach = Breach.memory if memory > memory_limit else Breach.cpu
            stop()
            return
