"""Worker slots for sandboxed runs: a fixed number at once, handed out fairly between requests.

A run is a child process (bubblewrap) that the event loop watches, so a slot is not a worker process
but a permission to run, and the uid the run gets when the service is root. Runs wait in a queue per
group (the server uses one group per request) and a freed slot goes to the group served least so far,
so a batch of 164 programs does not hold back another request's one program for longer than the runs
already going. The queue is bounded: a request whose runs would not fit is refused at once (the server
answers 503, and /health says saturated), rather than queued for minutes. A waiter that is cancelled
(its client went away, its deadline passed) leaves the queue, and a slot it was just handed goes on to
the next in line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Hashable, Sequence


class SlotPool:
    def __init__(self, slots: Sequence[int | None], max_queued: int) -> None:
        if not slots:
            raise ValueError("a slot pool needs at least one slot")
        self.size = len(slots)
        self.uids = tuple(slots)
        self.max_queued = max_queued
        self._free: collections.deque[int | None] = collections.deque(slots)
        self._waiting: dict[Hashable, collections.deque[asyncio.Future]] = {}
        self._served: dict[Hashable, int] = {}

    @property
    def queued(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    def admit(self, count: int) -> bool:
        """Whether `count` more runs fit in the queue bound (beyond those the free slots take now).
        Runs join the queue a loop turn after their request is admitted, so two requests admitted in
        the same turn may pass the bound by one request's runs."""
        return self.queued + count - len(self._free) <= self.max_queued

    @contextlib.asynccontextmanager
    async def slot(self, group: Hashable) -> AsyncIterator[int | None]:
        """A slot (its uid, or None) for one run; returned when the block ends."""
        uid = await self._acquire(group)
        try:
            yield uid
        finally:
            self._release(uid)

    async def _acquire(self, group: Hashable) -> int | None:
        if self._free and not self._waiting:
            return self._free.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self._served.setdefault(group, 0)
        self._waiting.setdefault(group, collections.deque()).append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed a slot the moment it gave up: pass it on
            else:
                self._forget(group, waiter)
            raise

    def _forget(self, group: Hashable, waiter: asyncio.Future) -> None:
        waiters = self._waiting.get(group)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiting[group]
                del self._served[group]

    def _release(self, uid: int | None) -> None:
        while self._waiting:
            group = min(self._waiting, key=self._served.__getitem__)  # min() keeps the oldest of equals
            waiters = self._waiting[group]
            waiter = waiters.popleft()
            self._served[group] += 1
            if not waiters:
                del self._waiting[group]
                del self._served[group]
            if not waiter.done():
                waiter.set_result(uid)
                return
        self._free.append(uid)
