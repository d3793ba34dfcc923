"""The killable worker pool: a hung task is killed at its deadline, a dead worker replaced, others go on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from services.scoring.pool import FairQueue, KillablePool, Task
from tests.helpers import ROOT


def task(kind: str, arg):
    """Runs in the pool's worker processes (so it lives at module level)."""
    if kind == "echo":
        return arg
    if kind == "pid":
        return os.getpid()
    if kind == "hang":
        time.sleep(3600)
    if kind == "exit":
        os._exit(arg)
    if kind == "allocate_mb":
        return len(bytearray(arg * 1024 * 1024))
    if kind == "unpicklable":
        return lambda: arg
    raise ValueError(arg)


@pytest.fixture()
def pool():
    pool = KillablePool(task, workers=2, timeout_s=0.5, memory_limit_mb=1024)
    pool.start()
    yield pool
    pool.close()


def test_results_and_errors(pool):
    assert pool.submit("echo", {"a": [1, 2]}).result(10).value == {"a": [1, 2]}
    failed = pool.submit("raise", "boom").result(10)
    assert failed.value is None and failed.error == "ValueError: boom"
    unsendable = pool.submit("unpicklable", 1).result(10)
    assert unsendable.error.startswith("unsendable result:") and pool.crashes == 0


def test_hung_task_is_killed_and_the_others_finish_meanwhile(pool):
    start = time.monotonic()
    hung = pool.submit("hang", None)
    quick = [pool.submit("echo", i) for i in range(20)]
    # the 20 quick tasks go through the other worker before the hung one reaches its deadline
    assert [f.result(10).value for f in quick] == list(range(20))
    assert not hung.done()
    outcome = hung.result(10)
    assert outcome.error == "timed out after 0.5s"
    assert 0.5 <= time.monotonic() - start < 5.0
    assert pool.timeouts == 1
    # both workers (one of them the replacement) serve new tasks
    assert [f.result(10).value for f in [pool.submit("echo", i) for i in range(4)]] == [0, 1, 2, 3]


def test_dead_worker_is_replaced(pool):
    before = {pool.submit("pid", None).result(10).value for _ in range(4)}
    outcome = pool.submit("exit", 3).result(10)
    assert outcome.error == "scoring worker died (exit code 3)"
    assert pool.crashes == 2  # it was tried once more on a fresh worker, which died too
    assert [pool.submit("echo", i).result(10).value for i in range(4)] == [0, 1, 2, 3]
    after = {pool.submit("pid", None).result(10).value for _ in range(8)}
    assert after != before  # one of the two processes is new


def test_memory_limit_turns_a_blowup_into_an_error(pool):
    assert pool.submit("allocate_mb", 8).result(10).value == 8 * 1024 * 1024
    outcome = pool.submit("allocate_mb", 4096).result(10)
    assert outcome.error is not None and outcome.error.startswith("MemoryError")
    assert pool.submit("echo", "still here").result(10).value == "still here"


def test_async_run_does_not_block_the_event_loop(pool):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        clock = asyncio.create_task(ticker())
        outcomes = await asyncio.gather(pool.run("hang", None), pool.run("echo", 1))
        clock.cancel()
        return outcomes, ticks

    (hung, echoed), ticks = asyncio.run(main())
    assert hung.error == "timed out after 0.5s" and echoed.value == 1
    assert ticks >= 20  # the loop kept ticking for the whole 0.5 s wait


def test_cancelled_queued_runs_leave_the_queue_at_once(pool):
    async def main():
        hung = [asyncio.ensure_future(pool.run("hang", i)) for i in range(2)]  # both workers busy
        waiting = [asyncio.ensure_future(pool.run("echo", i)) for i in range(5)]
        await asyncio.sleep(0.1)
        assert pool.queued == 5
        for future in waiting:
            future.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        # counted and gone now, not when a worker frees up half a second later
        assert pool.queued == 0 and pool.abandoned == 5
        return await asyncio.gather(*hung)

    assert all(outcome.error == "timed out after 0.5s" for outcome in asyncio.run(main()))
    assert pool.abandoned == 5


def test_close_fails_queued_tasks_and_stops_the_workers():
    pool = KillablePool(task, workers=1, timeout_s=0.5)
    pool.start()
    process = pool._workers[0].process
    running = pool.submit("hang", None)
    time.sleep(0.1)
    queued = [pool.submit("echo", i) for i in range(3)]
    pool.close()
    assert all(f.result(1).error == "the scoring pool was closed" for f in queued)
    assert running.result(1).error == "the scoring pool was closed"  # stopped, not left to its deadline
    assert not process.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("echo", 1)


def test_fair_queue_serves_the_least_served_group_first():
    queue = FairQueue()
    for i in range(3):
        queue.put(Task(("a", i), group="big"))
    first = queue.get()
    queue.put(Task(("b", 0), group="small"))  # arrives while the big group's first item runs
    queue.put(Task(("c", 0), group="other"))
    order = [first.args] + [queue.get().args for _ in range(4)]
    # newcomers (0 served) before the big group's second item; then the big group finishes in order
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("a", 2)]
    assert len(queue) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux kernel feature")
def test_a_worker_mid_task_dies_with_a_server_killed_outright(tmp_path):
    # A worker busy in a runaway computation never sees its pipe close; before PR_SET_PDEATHSIG such
    # workers outlived a SIGKILLed server for an hour, spinning.
    script = tmp_path / "server.py"
    script.write_text(
        "import time\n"
        "from services.scoring.pool import KillablePool\n"
        "from tests.services.test_reward_pool import task\n"
        "if __name__ == '__main__':\n"
        "    pool = KillablePool(task, workers=1, timeout_s=3600)\n"
        "    pool.start()\n"
        "    pool.submit('hang', None)\n"
        "    print(pool._workers[0].process.pid, flush=True)\n"
        "    time.sleep(3600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    worker = int(server.stdout.readline())
    time.sleep(0.5)  # the worker has the hung task
    assert _alive(worker)
    server.kill()
    server.wait()
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited
