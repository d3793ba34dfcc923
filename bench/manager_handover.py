"""The rollout manager's own cost: requests from the fit loop's thread to the manager's thread and back.

A replica that answers at once (n canned rollouts of --tokens tokens a prompt) stands in for the engines,
so what is timed is the crossing of threads, the pool's routing and the hand-back of the groups:

    prompts   one batch of --prompts prompts, each group awaited as the fit loop does (generate_async
              per prompt, gathered)
    turns     --prompts x n trajectories of --turns model turns each, every turn its own request with its
              trajectory's routing key, as the agent loop makes them

each with the manager on the caller's loop (`loop`: the trainer's way) and on its own thread (`thread`: a
hand-over to it and back per request). Each runs --repeats times; the median and the range of the wall
seconds are printed. To compare two trees, run this file with PYTHONPATH set to each (`git archive
<commit> | tar -x -C /tmp/base`; `--modes thread` for a tree without `loop=`):

    python bench/manager_handover.py
    PYTHONPATH=/tmp/base python bench/manager_handover.py --modes thread
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


def timed(mode: str, pool: ReplicaPool, shape) -> float:
    """Seconds of one run of `shape(manager)`, the manager on this run's loop or on its own thread."""

    async def run() -> float:
        mine = {"loop": asyncio.get_running_loop()} if mode == "loop" else {}  # old trees lack loop=
        manager = RolloutManager(pool, **mine)
        started = time.perf_counter()
        await shape(manager)
        seconds = time.perf_counter() - started
        manager.close() if mode == "thread" else None
        return seconds

    return asyncio.run(run())


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
    parser.add_argument("--modes", default="loop,thread")
    args = parser.parse_args()
    shapes = {
        f"prompts ({args.prompts} x n={args.n})": (
            args.n,
            lambda m: prompts(m, args.prompts, SamplingParams(n=args.n, seed=1)),
        ),
        f"turns ({args.prompts * args.n} trajectories x {args.turns})": (
            1,
            lambda m: turns(m, args.prompts * args.n, args.turns, SamplingParams(n=1, seed=1)),
        ),
    }
    for name, (n, shape) in shapes.items():
        for mode in args.modes.split(","):
            seconds = []
            for _ in range(args.repeats):
                pool = ReplicaPool([AnsweringReplica(n, args.tokens) for _ in range(args.replicas)])
                seconds.append(timed(mode, pool, shape))
            print(
                f"{name:<36} {mode:<7} median {statistics.median(seconds):.3f} s  "
                f"(range {min(seconds):.3f}-{max(seconds):.3f}, {args.repeats} runs)",
                flush=True,
            )


if __name__ == "__main__":
    main()
