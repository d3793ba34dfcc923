"""The rollout manager's own cost: requests from the fit loop's thread to the manager's thread and back.

A replica that answers at once (n canned rollouts of --tokens tokens a prompt) stands in for the engines,
so what is timed is the crossing of threads, the pool's routing and the hand-back of the groups:

    prompts   one batch of --prompts prompts, each group awaited as the fit loop does (generate_async
              per prompt, gathered)
    turns     --prompts x n trajectories of --turns model turns each, every turn its own request with its
              trajectory's routing key, as the agent loop makes them

Each shape runs --repeats times; the median and the range of the wall seconds are printed. To compare two
trees, run this file with PYTHONPATH set to each (`git archive <commit> | tar -x -C /tmp/base`):

    python bench/manager_handover.py
    PYTHONPATH=/tmp/base python bench/manager_handover.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.manager import RolloutManager
from trainer.rollout.pool import ReplicaPool


class AnsweringReplica:
    """Answers every request after one turn of the manager's loop, with canned rollouts."""

    capacity = None

    def __init__(self, n: int, tokens: int) -> None:
        self.n, self.tokens = n, tokens

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        await asyncio.sleep(0)
        ids = list(range(self.tokens))
        return [
            Rollout(
                payload["input_ids"], ids, [-1.0] * self.tokens, [1] * self.tokens, "length", prompt_index
            )
            for _ in range(self.n)
        ]

    async def release_memory_occupation(self, tags=None) -> None: ...
    async def resume_memory_occupation(self, tags=None) -> None: ...
    async def health(self) -> bool:
        return True

    async def close(self) -> None: ...


async def prompts(manager: RolloutManager, count: int, sampling: SamplingParams) -> None:
    async def one(index: int) -> None:
        await manager.generate_async([[1, 2, 3, index]], sampling, first_index=index)

    await asyncio.gather(*(one(i) for i in range(count)))


async def turns(manager: RolloutManager, trajectories: int, count: int, sampling: SamplingParams) -> None:
    async def trajectory(index: int) -> None:
        for _ in range(count):
            await manager.generate_async([[1, 2, 3, index]], sampling, key=f"t{index}")

    await asyncio.gather(*(trajectory(i) for i in range(trajectories)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    pool = ReplicaPool([AnsweringReplica(args.n, args.tokens) for _ in range(args.replicas)])
    manager = RolloutManager(pool, pad_id=0)
    shapes = {
        f"prompts ({args.prompts} x n={args.n})": lambda: prompts(
            manager, args.prompts, SamplingParams(n=args.n, seed=1)
        ),
        f"turns ({args.prompts * args.n} trajectories x {args.turns})": lambda: turns(
            manager, args.prompts * args.n, args.turns, SamplingParams(n=1, seed=1)
        ),
    }
    try:
        for name, shape in shapes.items():
            seconds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                asyncio.run(shape())
                seconds.append(time.perf_counter() - started)
            print(
                f"{name:<36} median {statistics.median(seconds):.3f} s  "
                f"(range {min(seconds):.3f}-{max(seconds):.3f}, {args.repeats} runs)",
                flush=True,
            )
    finally:
        manager.close()


if __name__ == "__main__":
    main()
