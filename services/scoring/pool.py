"""A small process pool whose workers can be killed: for scorers that may hang or blow up (math-verify/sympy).

concurrent.futures.ProcessPoolExecutor cannot stop one running task, and a hung task would hold
a worker forever. Here each worker is one process with one pipe, driven by one thread of ours that
sends it a task and waits at most `timeout_s` for the answer. If the deadline passes the process is
SIGKILLed and replaced; if it dies (segfault, out of memory) it is replaced and the task is tried
once more on the fresh process (a worker that died while idle must not cost the next, unrelated
item); only a task that kills two workers fails, with `Outcome.error` saying why.

Tasks are queued per `group` (the reward-server uses one group per request) and the workers take
next from the group served least so far, so a request of many slow items cannot hold back another
request's one quick item for longer than the items already running. A caller that stops waiting (its client
went away, its request deadline passed) abandons its tasks: queued ones are dropped, a running one
has its worker killed and replaced.

Workers come from a forkserver that has already imported the scorer's modules, so a replacement
starts in milliseconds rather than re-importing sympy. Each worker may carry an address-space limit
so a runaway expression ends in MemoryError, not the host's OOM killer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("services.scoring.pool")

START_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
ABANDON_POLL_S = 0.05  # how often a driver thread looks up from a running task to see if it was abandoned


@dataclass(frozen=True)
class Outcome:
    """What one task produced: `value` on success, else `error` (timeout, crash, or the exception raised)."""

    value: Any = None
    error: str | None = None


@dataclass(eq=False)
class Task:
    args: tuple
    group: Hashable
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    abandoned: threading.Event = field(default_factory=threading.Event)
    reason: str = "abandoned by its request"

    def abandon(self, reason: str | None = None) -> None:
        """Drop the task if it is still queued; kill its worker if it is running."""
        self.reason = reason or self.reason
        self.abandoned.set()
        self.future.cancel()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent, the forkserver, exits, so a worker
    stuck in a runaway computation (where it never reads its closed pipe) does not outlive a server
    that was killed outright.

    The forkserver exits once every holder of its "alive" pipe has gone, and it hands a copy to each
    process it forks: a worker that kept it would keep the forkserver, and so itself, alive. Workers
    never fork, so they close it.
    """
    if not sys.platform.startswith("linux"):
        return
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _serve(conn, fn: Callable, memory_limit_bytes: int) -> None:
    """Worker process: answer (args) with (True, fn(*args)) or (False, "why") until the pipe closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_limit_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            reply = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - anything the scorer raises becomes that task's error
            reply = (False, f"{type(exc).__name__}: {str(exc)[:200]}")
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - the result would not pickle: report it, not a crash
            conn.send((False, f"unsendable result: {type(exc).__name__}: {str(exc)[:200]}"))


class _Worker:
    """One process and its pipe, restarted whenever it overruns or dies."""

    def __init__(self, context, fn: Callable, memory_limit_bytes: int) -> None:
        self.context = context
        self.fn = fn
        self.memory_limit_bytes = memory_limit_bytes
        self.process = None
        self.conn = None

    def start(self) -> None:
        parent_conn, child_conn = self.context.Pipe()
        process = self.context.Process(
            target=_serve, args=(child_conn, self.fn, self.memory_limit_bytes), daemon=True
        )
        process.start()
        child_conn.close()
        try:
            ready = parent_conn.poll(START_TIMEOUT_S) and parent_conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            process.kill()
            process.join()
            raise RuntimeError(
                f"scoring worker did not start within {START_TIMEOUT_S:.0f}s (exit code {process.exitcode})"
            )
        self.process, self.conn = process, parent_conn

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
        self.process, self.conn = None, None

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def attempt(self, task: Task, timeout_s: float) -> tuple[Outcome, str]:
        """(outcome, event): event is "" or "timeout" / "crash" / "abandoned" for the pool's counters."""
        if self.process is None:
            self.start()
        try:
            self.conn.send(task.args)
            answered = self._wait(task, timeout_s)
        except OSError:
            answered = True  # broken pipe: the recv below sees the EOF and reports the crash
        if answered is None:
            self.stop(kill=True)  # the next task starts a fresh process (none is needed if we are closing)
            return Outcome(error=task.reason), "abandoned"
        if not answered:
            self.restart()
            return Outcome(error=f"timed out after {timeout_s:g}s"), "timeout"
        try:
            ok, payload = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            exitcode = self.process.exitcode
            self.restart()
            return Outcome(error=f"scoring worker died (exit code {exitcode})"), "crash"
        return (Outcome(value=payload) if ok else Outcome(error=payload)), ""

    def _wait(self, task: Task, timeout_s: float) -> bool | None:
        """True once the worker answered, False at the deadline, None if the task was abandoned first."""
        waited = 0.0
        while waited < timeout_s:
            step = min(ABANDON_POLL_S, timeout_s - waited)
            if self.conn.poll(step):
                return True
            if task.abandoned.is_set():
                return None
            waited += step
        return False


class FairQueue:
    """Tasks queued per group; the next task comes from the group that has had the fewest so far
    (the oldest such group on a tie), FIFO within a group. A newcomer's first item thus goes before a
    large group's next one, and groups that keep coming back share the workers evenly."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, collections.deque] = {}  # insertion order = arrival order
        self._taken: dict[Hashable, int] = {}
        self._ready = threading.Condition()
        self._stopping = 0

    def put(self, task: Task) -> None:
        with self._ready:
            if task.group not in self._groups:
                self._groups[task.group] = collections.deque()
                self._taken.setdefault(task.group, 0)
            self._groups[task.group].append(task)
            self._ready.notify()

    def get(self) -> Task | None:
        """The next task, or None when a driver should stop. Blocks while the queue is empty."""
        with self._ready:
            while not self._groups and not self._stopping:
                self._ready.wait()
            if not self._groups:
                self._stopping -= 1
                return None
            group = min(self._groups, key=self._taken.__getitem__)  # min() keeps the first of equals
            tasks = self._groups[group]
            task = tasks.popleft()
            self._taken[group] += 1
            if not tasks:
                del self._groups[group]
                del self._taken[group]
            return task

    def remove(self, task: Task) -> bool:
        """Take `task` out of the line; False if a driver already took it."""
        with self._ready:
            tasks = self._groups.get(task.group)
            if tasks is None or task not in tasks:
                return False
            tasks.remove(task)
            if not tasks:
                del self._groups[task.group]
                del self._taken[task.group]
            return True

    def drain(self) -> list[Task]:
        with self._ready:
            tasks = [task for tasks in self._groups.values() for task in tasks]
            self._groups.clear()
            self._taken.clear()
            return tasks

    def stop(self, drivers: int) -> None:
        with self._ready:
            self._stopping += drivers
            self._ready.notify_all()

    def __len__(self) -> int:
        with self._ready:
            return sum(len(tasks) for tasks in self._groups.values())


class KillablePool:
    """`workers` processes running `fn` (a module-level function) with a deadline per task."""

    def __init__(
        self,
        fn: Callable,
        workers: int,
        timeout_s: float,
        memory_limit_mb: int = 0,
        preload: Sequence[str] = (),
    ) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.timeouts = 0
        self.crashes = 0
        self.abandoned = 0
        self._counts_lock = threading.Lock()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([fn.__module__, *preload])
        self._workers = [_Worker(context, fn, memory_limit_mb * 1024 * 1024) for _ in range(workers)]
        self._queue = FairQueue()
        self._running: dict[int, Task] = {}  # driver index -> the task its worker is running
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        """Start every worker now (so a broken install fails at load time, not on the first task)."""
        for worker in self._workers:
            worker.start()
        for index, worker in enumerate(self._workers):
            thread = threading.Thread(
                target=self._drive, args=(index, worker), name=f"pool-worker-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit_task(self, *args, group: Hashable = None) -> Task:
        if self._closed:
            raise RuntimeError("the pool is closed")
        task = Task(args, group)
        self._queue.put(task)
        return task

    def submit(self, *args, group: Hashable = None) -> concurrent.futures.Future:
        return self.submit_task(*args, group=group).future

    async def run(self, *args, group: Hashable = None) -> Outcome:
        """The task's outcome; cancelling the awaiting coroutine abandons the task."""
        task = self.submit_task(*args, group=group)
        try:
            return await asyncio.wrap_future(task.future)
        except asyncio.CancelledError:
            task.abandon()
            # Still queued: drop it now, so the queue gauge and the counter say so at once (a driver
            # would otherwise count it only when its turn came, after the items ahead of it).
            if self._queue.remove(task):
                self._count("abandoned")
            raise

    def _drive(self, index: int, worker: _Worker) -> None:
        while (task := self._queue.get()) is not None:
            if not task.future.set_running_or_notify_cancel():
                self._count("abandoned")  # dropped while queued: its request ended
                continue
            self._running[index] = task
            task.future.set_result(self._run(worker, task))
            self._running.pop(index, None)
        worker.stop()

    def _run(self, worker: _Worker, task: Task) -> Outcome:
        """One task, retried once on a fresh process if its worker died (it may have died while idle)."""
        for attempt in (1, 2):
            try:
                outcome, event = worker.attempt(task, self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - e.g. a replacement worker that would not start
                outcome, event = Outcome(error=f"scoring worker unavailable: {exc}"), "crash"
            if event:
                self._count(event)
            if event != "crash" or attempt == 2 or task.abandoned.is_set():
                break
            log.warning("scoring worker died; trying the task once more on a fresh one")
        if event in ("timeout", "crash"):
            log.warning("scoring task failed", extra={"error": outcome.error})
        return outcome

    def _count(self, event: str) -> None:
        with self._counts_lock:
            self.timeouts += event == "timeout"
            self.crashes += event == "crash"
            self.abandoned += event == "abandoned"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Tasks nobody will run now: fail them rather than leave their callers waiting.
        for task in self._queue.drain():
            if task.future.set_running_or_notify_cancel():
                task.future.set_result(Outcome(error="the scoring pool was closed"))
        for task in list(self._running.values()):  # nobody will wait for these: stop them now
            task.abandon("the scoring pool was closed")
        self._queue.stop(len(self._threads))
        for thread, worker in zip(self._threads, self._workers):
            thread.join(self.timeout_s + 5.0)  # each thread stops its worker on the way out
            if thread.is_alive() and worker.process is not None:
                worker.process.kill()
        for worker in self._workers[len(self._threads) :]:  # start() failed part-way: no thread owns these
            worker.stop(kill=True)
