"""What a rollout phase's KV resume costs when every GPU's rank does it at once (GPU; 4 GPUs for the
contended case).

    python bench/alloc_contention.py            # on a CUDA machine, ~1 min

Each process drives one GPU as a colocated policy rank does: an update-like phase allocates ~300 blocks
of 16-280 MB (~45 GB) and frees them into the caching allocator; then, timed,
  resume  empty_cache + the KV cache (2 x 9.5 GB, zeroed): what the built-in engine's resume did
          before 2026-11-29 (returns the update's blocks to the device, asks for the cache anew)
  reuse   the same KV cache from the allocator's cached blocks, no empty_cache
  update  the update-like allocations again (cudaMalloc where the cache has no block)
with 1 process and with 4 at once (one per GPU, started together at a barrier). Prints the median of
six rounds (after one warm-up) of the slowest process, in ms.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

BLOCKS, KV_BYTES, ROUNDS = 300, 9_500 << 20, 7


def timed(barrier, fn) -> float:
    barrier.wait()  # every process starts the phase together, as the ranks do after the driver's call
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(rank: int, barrier, out) -> None:
    torch.cuda.set_device(rank)
    generator = torch.Generator().manual_seed(rank)
    sizes = [int(s) for s in torch.randint(16 << 20, 280 << 20, (BLOCKS,), generator=generator)]
    held: dict[str, list] = {}

    def update() -> None:
        held["blocks"] = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]

    def kv() -> None:
        held["kv"] = [torch.zeros(KV_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]

    def resume() -> None:
        torch.cuda.empty_cache()
        kv()

    times: dict[str, list[float]] = {"update": [], "resume": [], "reuse": []}
    for _ in range(ROUNDS):
        times["update"].append(timed(barrier, update))
        held.pop("blocks")
        times["resume"].append(timed(barrier, resume))
        held.pop("kv")
        times["reuse"].append(timed(barrier, kv))
        held.pop("kv")
    out.put({name: statistics.median(values[1:]) for name, values in times.items()})


def main() -> None:
    context = mp.get_context("spawn")
    for processes in [1, 4] if torch.cuda.device_count() >= 4 else [1]:
        barrier, out = context.Barrier(processes), context.Queue()
        workers = [context.Process(target=worker, args=(r, barrier, out)) for r in range(processes)]
        for w in workers:
            w.start()
        results = [out.get() for _ in workers]
        for w in workers:
            w.join()
        slowest = {name: max(r[name] for r in results) for name in results[0]}
        print(f"{processes} process(es): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in slowest.items()))


if __name__ == "__main__":
    main()
