"""Does the thread a training pass runs on change its speed on a GPU? (issue 24's regression lead)

The one-trainer rank actor runs its calls on a thread Ray made (a concurrency-group actor's default
thread, `Dummy-1`), where the old plain actor ran them on the process's main thread; its training passes
measured 1.2-2x slower on H200s. This probe runs the same compiled, launch-bound work (Qwen2.5-0.5B's
MLP blocks: RMSNorm, SwiGLU, residual, per-layer torch.compile with dynamic shapes, bf16 autocast, AdamW)
in each placement and prints the seconds of a no-grad forward pass and of a train step:

    main      this process's main thread
    thread    a threading.Thread of this process
    plain     a plain Ray actor (calls on its main thread)
    group     a Ray actor with a concurrency group (default calls on a Ray-made thread)
    group+    the same, with an idle asyncio loop thread and an idle queue-blocked thread beside it

    python bench/thread_probe.py [--layers 24] [--tokens 8192] [--iters 8] [--only main,group]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        gate, up = self.gate_up(h.to(x.dtype)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Work:
    def __init__(self, layers: int, hidden: int, inter: int, tokens: int, device: str) -> None:
        self.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        if device == "cuda":
            torch.cuda.set_device(self.device)
            compiled = torch.compile(Block.forward, dynamic=True)
        self.blocks = nn.ModuleList(Block(hidden, inter) for _ in range(layers)).to(self.device)
        for block in self.blocks:
            if device == "cuda":  # the trainer compiles on CUDA only
                block.forward = compiled.__get__(block)
        self.optimizer = torch.optim.AdamW(self.blocks.parameters(), lr=1e-5, fused=device == "cuda")
        self.hidden, self.tokens = hidden, tokens
        self.calls = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _input(self, i: int) -> torch.Tensor:
        n = self.tokens - 7 * (i % 5)  # a packed micro-batch's token count changes every time
        return torch.randn(n, self.hidden, device=self.device)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            for block in self.blocks:
                x = block(x)
        return x

    def run(self, iters: int) -> dict[str, float]:
        import torch._dynamo.utils as dynamo_utils

        self.calls += 1
        self._sync()
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(iters):
                self._forward(self._input(i))
        self._sync()
        forward = (time.perf_counter() - start) / iters
        start = time.perf_counter()
        for i in range(iters):
            loss = self._forward(self._input(i)).float().pow(2).mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        train = (time.perf_counter() - start) / iters
        frames = dynamo_utils.counters["stats"].get("unique_graphs", 0)
        return {
            "forward_s": forward,
            "train_s": train,
            "graphs": frames,
            "thread": threading.current_thread().name,
        }


class Idle:
    """What the rank has beside its calls: an idle asyncio loop thread and a thread blocked on a queue."""

    def __init__(self) -> None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="replica", daemon=True).start()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=inbox.get, name="rollout-engine", daemon=True).start()
        self.keep = (loop, inbox)


class ProbeActor:
    def __init__(self, args: dict, idle: bool) -> None:
        self.args, self.idle = args, idle
        self.work = None

    def setup(self) -> str:
        self.work = Work(**self.args)
        self.extra = Idle() if self.idle else None
        return threading.current_thread().name

    def run(self, iters: int) -> dict[str, float]:
        return self.work.run(iters)

    def replica(self) -> None:  # a method in the concurrency group, as the rank's engine calls are
        return None


def in_process(args: dict, iters: int, repeats: int, threaded: bool) -> list[dict]:
    out: list[dict] = []

    def body() -> None:
        work = Work(**args)
        for _ in range(repeats):
            out.append(work.run(iters))

    if threaded:
        thread = threading.Thread(target=body, name="worker")
        thread.start()
        thread.join()
    else:
        body()
    return out


def in_ray(args: dict, iters: int, repeats: int, group: bool, idle: bool) -> list[dict]:
    import ray

    options = {"concurrency_groups": {"replica": 8}} if group else {}
    gpus = 1 if args["device"] == "cuda" else 0
    actor = ray.remote(num_gpus=gpus, **options)(ProbeActor).remote(args, idle)
    ray.get(actor.setup.remote())
    if group:
        ray.get(actor.replica.options(concurrency_group="replica").remote())
    results = [ray.get(actor.run.remote(iters)) for _ in range(repeats)]
    ray.kill(actor)
    time.sleep(2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--inter", type=int, default=4864)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--only", default="main,thread,plain,group,group+")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a plumbing check")
    a = parser.parse_args()
    args = {"layers": a.layers, "hidden": a.hidden, "inter": a.inter, "tokens": a.tokens, "device": a.device}
    cases = a.only.split(",")
    if any(c in ("plain", "group", "group+") for c in cases):
        import ray

        ray.init(num_gpus=int(a.device == "cuda"), num_cpus=4, include_dashboard=False)
    print(f"{'case':8} {'call':>4} {'forward s':>10} {'train s':>9} {'graphs':>6}  thread", flush=True)
    for case in cases:
        if case in ("main", "thread"):
            rows = in_process(args, a.iters, a.repeats, threaded=case == "thread")
        else:
            rows = in_ray(args, a.iters, a.repeats, group=case != "plain", idle=case == "group+")
        for i, row in enumerate(rows):
            print(
                f"{case:8} {i:>4} {row['forward_s']:>10.4f} {row['train_s']:>9.4f} {row['graphs']:>6}  "
                f"{row['thread']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
