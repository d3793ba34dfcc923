"""ReplicaPool: route each generate request to the least-loaded live replica; retry a dead one's elsewhere.

A replica is anything with the SGLang-API calls of HttpReplica (a server, SGLang or built-in),
LocalReplica (the engine in this process) or a policy rank's engine (trainer/parallel/placement.py's
RankReplica); the pool does not care which. Load is the number of sequences (prompts x n) the pool has
in flight on a replica. With a capacity (the pool's, or the replica's own `capacity`: its KV slots), a
request waits until some replica has room, so a fast replica pulls more work than a slow one instead of
every request being split evenly up front (the routing of slime's and verl's agent-loop managers).
A request with a routing `key` (a multi-turn trajectory) goes where that key's first request went, so
its turns meet their own prefix in the replica's cache; `forget(keys)` ends the stickiness.

A replica that fails a call (ReplicaDown) is set aside and its request goes to another; `revive()` lets
it back once its /health answers. One that missed a weight update while away would sample from stale
weights: revive() brings it back only after `resync(replica)` (the caller's re-send of the weights).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from trainer.rollout.base import Rollout
from trainer.rollout.client import ReplicaDown

log = logging.getLogger("trainer.rollout")

T = TypeVar("T")


class RolloutUnavailable(RuntimeError):
    """No replica could serve a request."""


class Replica(Protocol):
    name: str

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]: ...
    async def update_weights_from_disk(self, model_path: str, **kwargs) -> None: ...
    async def release_memory_occupation(self, tags=None) -> None: ...
    async def resume_memory_occupation(self, tags=None) -> None: ...
    async def health(self) -> bool: ...
    async def close(self) -> None: ...


@dataclass(eq=False)
class _Member:
    replica: Replica
    capacity: int | None = None
    load: int = 0
    served: int = 0
    alive: bool = True
    weights_version: int = 0


class ReplicaPool:
    def __init__(
        self, replicas: Sequence[Replica], *, capacity: int | None = None, attempts: int = 3
    ) -> None:
        """capacity: most sequences in flight per replica (None: no limit). attempts: replicas tried per
        request before giving up."""
        if not replicas:
            raise ValueError("a replica pool needs at least one replica")
        self.members = [_Member(r, capacity or getattr(r, "capacity", None)) for r in replicas]
        self.attempts = attempts
        self.affinity: dict[str, _Member] = {}
        self.weights_version = 0
        self.retried = 0  # requests re-sent after a replica failed them (a metric)
        self._room: asyncio.Condition | None = None

    @property
    def alive(self) -> list[Replica]:
        return [m.replica for m in self.members if m.alive]

    async def rollouts(
        self, payload: dict, prompt_index: int, weight: int = 1, key: str | None = None
    ) -> list[Rollout]:
        """One prompt's samples as Rollouts (weight: its sequences) from the least-loaded live replica."""
        return await self._send(lambda replica: replica.rollouts(payload, prompt_index), weight, key)

    def forget(self, keys) -> None:
        """End the routing of these keys (finished trajectories)."""
        for key in keys:
            self.affinity.pop(key, None)

    async def _send(self, call: Callable[[Replica], Awaitable[T]], weight: int, key: str | None) -> T:
        problems: list[str] = []
        for attempt in range(self.attempts):
            member = await self._acquire(weight, key)
            try:
                result = await call(member.replica)
            except ReplicaDown as exc:
                problems.append(str(exc))
                self._set_aside(member, exc)
                self.retried += attempt + 1 < self.attempts
                continue
            finally:
                await self._release(member, weight)
            member.served += 1
            return result
        raise RolloutUnavailable(f"no replica served the request: {'; '.join(problems)}")

    async def _acquire(self, weight: int, key: str | None = None) -> _Member:
        room = self._condition()
        async with room:
            while True:
                live = [m for m in self.members if m.alive]
                if not live:
                    raise RolloutUnavailable("every rollout replica is down")
                pinned = self.affinity.get(key) if key is not None else None
                candidates = [pinned] if pinned is not None and pinned.alive else live
                fits = [m for m in candidates if self._fits(m, weight)]
                if fits:
                    member = min(fits, key=lambda m: (m.load, m.served))
                    member.load += weight
                    if key is not None:
                        self.affinity[key] = member
                    return member
                await room.wait()

    @staticmethod
    def _fits(member: _Member, weight: int) -> bool:
        capacity = member.capacity
        return capacity is None or member.load == 0 or member.load + weight <= capacity

    async def _release(self, member: _Member, weight: int) -> None:
        room = self._condition()
        async with room:
            member.load -= weight
            room.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._room is None:  # created lazily: it binds to the loop that first uses it
            self._room = asyncio.Condition()
        return self._room

    def _set_aside(self, member: _Member, exc: BaseException) -> None:
        if member.alive:
            log.warning(f"rollout replica {member.replica.name} set aside: {exc}")
        member.alive = False

    async def revive(self, resync: Callable[[Replica], Awaitable[Any]] | None = None) -> list[str]:
        """Bring back set-aside replicas that answer /health; one that missed a weight update comes back
        only through resync(replica). Returns the names brought back."""
        back = []
        for member in self.members:
            if member.alive or not await member.replica.health():
                continue
            if member.weights_version != self.weights_version:
                if resync is None:
                    continue
                try:
                    await resync(member.replica)
                except ReplicaDown:
                    continue
                member.weights_version = self.weights_version
            member.alive = True
            back.append(member.replica.name)
        if back:
            room = self._condition()
            async with room:
                room.notify_all()
        return back

    async def broadcast(self, call: Callable[[Replica], Awaitable[Any]]) -> None:
        """call(replica) on every live replica at once; a replica that fails it is set aside."""
        live = [m for m in self.members if m.alive]
        results = await asyncio.gather(*(call(m.replica) for m in live), return_exceptions=True)
        errors = []
        for member, result in zip(live, results):
            if isinstance(result, ReplicaDown):
                self._set_aside(member, result)
            elif isinstance(result, BaseException):
                errors.append(result)
        if errors:
            raise errors[0]
        if not any(m.alive for m in self.members):
            raise RolloutUnavailable("every rollout replica is down")

    async def update_weights(self, call: Callable[[Replica], Awaitable[Any]]) -> None:
        """broadcast() a weight update; replicas that missed it stay out of revive() until the next one."""
        await self.broadcast(call)
        self.weights_version += 1
        for member in self.members:
            if member.alive:
                member.weights_version = self.weights_version

    async def close(self) -> None:
        await asyncio.gather(*(m.replica.close() for m in self.members), return_exceptions=True)
