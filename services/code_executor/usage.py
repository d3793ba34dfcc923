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
- the exact read walks every resident page, so it costs time in proportion to the memory the run's
  processes map together (a 700 MB buffer shared by 41 processes: about a second). Each sample is
  taken in a thread of the guard's own, never on the event loop, which goes on serving requests and
  every run's deadline; and after an exact read that took t, the next one waits `EXACT_BACKOFF` * t
  (`Meter`). In between, the last exact figure plus what the cheap bound grew since stands in, and
  where that passes the limit an exact read is made at once: a breach is always an exact figure. So
  the exact reads take at most 1 / (1 + EXACT_BACKOFF) of the guard's time while the bound holds
  still; while it grows (a run forking), they are made as often as before, in the guard's thread.
  What the stand-in misses is memory made while as much shared memory is let go (a child that drops
  its copy-on-write share and allocates as much), caught by the next exact read;
- CPU time is user + system time of the live processes plus what their reaped children used
  (/proc/PID/stat's utime, stime, cutime, cstime); a child reaped by no one (its parent ignores
  SIGCHLD) drops out of the sum, a gap the per-process RLIMIT_CPU still covers.

Past a limit, the guard stops the run through its `Stopper` (which kills the whole PID namespace). A
run can thus overshoot for up to one sample before it is stopped (up to a back-off, where the exact
reads are slow); the per-process rlimits set by `prlimit` (RLIMIT_AS, RLIMIT_CPU) stay as the first
line, so no single process goes past the limit even within a sample. The scratch tmpfs mounts are
capped by their own size, not by this sum; memory that no process maps (SysV shared memory, memfd
files) is refused by the sandbox's seccomp filter (seccomp.py), since no sum of processes could see it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.03
EXACT_BACKOFF = 4.0  # after an exact read that took t, the next waits EXACT_BACKOFF * t
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


class Meter:
    """Measures one run, sample after sample, and remembers what it knew at its last exact read, so
    that a slow exact read is not repeated at once (see the module docstring)."""

    def __init__(self, memory_limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_limit = memory_limit
        self.clock = clock
        self.known_bytes = 0  # an upper bound of the run's memory when `known_bound` was read
        self.known_bound = 0
        self.next_exact = 0.0  # before this `clock()` time, an exact read is made only when needed

    def measure(self, init_pid: int) -> tuple[int, float]:
        """(memory, CPU seconds) of the run under `init_pid`. The memory is what the limit is checked
        on: the cheap bound where it is under the limit, else the exact figure, or the stand-in for it
        while the exact reads are backed off and the stand-in is under the limit."""
        pids = run_processes(init_pid)
        bound, cpu_s = sample(pids)
        if bound <= self.memory_limit:
            self.known_bytes = self.known_bound = bound
            return bound, cpu_s
        stand_in = self.known_bytes + max(0, bound - self.known_bound)
        if self.clock() < self.next_exact and stand_in <= self.memory_limit:
            return stand_in, cpu_s
        started = self.clock()
        self.known_bytes, self.known_bound = proportional_memory(pids), bound
        ended = self.clock()
        self.next_exact = ended + EXACT_BACKOFF * (ended - started)
        return self.known_bytes, cpu_s


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
    first sample comes one interval in: most runs are over by then, and cost nothing to guard.

    Each sample is read in this guard's own thread (made at its first sample): a slow one holds up
    neither the event loop nor another run's guard. A sample still being read when the guard is
    cancelled finishes in that thread, unheard."""
    loop = asyncio.get_running_loop()
    meter = Meter(memory_limit)
    thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="usage-guard")
    try:
        while True:
            await asyncio.sleep(interval_s)
            pid = init_pid()
            if pid is None:
                continue
            try:
                memory, cpu_s = await loop.run_in_executor(thread, meter.measure, pid)
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
    finally:
        thread.shutdown(wait=False)  # never wait on the loop for a sample nobody needs now
