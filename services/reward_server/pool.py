"""A small process pool whose workers can be killed: for scorers that may hang or blow up (math-verify/sympy).

concurrent.futures.ProcessPoolExecutor cannot stop one running task, and a hung task would hold
a worker forever. Here each worker is one process with one pipe, driven by one thread of ours that
sends it a task and waits at most `timeout_s` for the answer. If the deadline passes the process is
SIGKILLed and replaced; if it dies (segfault, out of memory) it is replaced; either way only that
task fails, with `Outcome.error` saying why, and the other workers carry on.

Workers come from a forkserver that has already imported the scorer's modules, so a replacement
starts in milliseconds rather than re-importing sympy. Each worker may carry an address-space limit
so a runaway expression ends in MemoryError, not the host's OOM killer.

Callers get a concurrent.futures.Future per task (`submit`) or await one (`run`): the asyncio event
loop only ever waits on futures, never on a worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("services.reward_server.pool")

START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """What one task produced: `value` on success, else `error` (timeout, crash, or the exception raised)."""

    value: Any = None
    error: str | None = None


def _serve(conn, fn: Callable, memory_limit_bytes: int) -> None:
    """Worker process: answer (args) with (True, fn(*args)) or (False, "why") until the pipe closes."""
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

    def run(self, args: tuple, timeout_s: float) -> tuple[Outcome, str]:
        """(outcome, event) where event is "" or "timeout" / "crash" for the pool's counters."""
        if self.process is None:
            self.start()
        try:
            self.conn.send(args)
            answered = self.conn.poll(timeout_s)
        except OSError:
            answered = True  # broken pipe: the recv below sees the EOF and reports the crash
        if not answered:
            self.stop(kill=True)
            self.start()
            return Outcome(error=f"timed out after {timeout_s:g}s"), "timeout"
        try:
            ok, payload = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            exitcode = self.process.exitcode
            self.stop(kill=True)
            self.start()
            return Outcome(error=f"scoring worker died (exit code {exitcode})"), "crash"
        return (Outcome(value=payload) if ok else Outcome(error=payload)), ""


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
        self._counts_lock = threading.Lock()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([fn.__module__, *preload])
        self._workers = [_Worker(context, fn, memory_limit_mb * 1024 * 1024) for _ in range(workers)]
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        """Start every worker now (so a broken install fails at load time, not on the first task)."""
        for worker in self._workers:
            worker.start()
        for index, worker in enumerate(self._workers):
            thread = threading.Thread(
                target=self._drive, args=(worker,), name=f"pool-worker-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def submit(self, *args) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the pool is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, args))
        return future

    async def run(self, *args) -> Outcome:
        return await asyncio.wrap_future(self.submit(*args))

    def _drive(self, worker: _Worker) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                break
            future, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                outcome, event = worker.run(args, self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - e.g. a replacement worker that would not start
                outcome, event = Outcome(error=f"scoring worker unavailable: {exc}"), "crash"
            if event:
                with self._counts_lock:
                    self.timeouts += event == "timeout"
                    self.crashes += event == "crash"
                log.warning("scoring task failed", extra={"error": outcome.error})
            future.set_result(outcome)
        worker.stop()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while True:  # tasks nobody will run now: fail them rather than leave their callers waiting
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task[0].set_running_or_notify_cancel():
                task[0].set_result(Outcome(error="the scoring pool was closed"))
        for _ in self._threads:
            self._tasks.put(None)
        for thread, worker in zip(self._threads, self._workers):
            thread.join(self.timeout_s + 5.0)  # each thread stops its worker on the way out
            if thread.is_alive() and worker.process is not None:
                worker.process.kill()
        for worker in self._workers[len(self._threads) :]:  # start() failed part-way: no thread owns these
            worker.stop(kill=True)
