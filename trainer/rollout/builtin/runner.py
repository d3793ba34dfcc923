"""Running one decode step: host -> device inputs, the forward (eager or a CUDA-graph replay), and
device -> host results, without ever blocking the host on the GPU.

CUDA graphs: the decode forward of a batch of b sequences is captured once per bucket size (the
smallest bucket >= b); rows past b are padding that point at the KV cache's scratch slot with length 1.
The graph reads its inputs from fixed device buffers (slots and lengths; the input token comes from
`last_token[slot]`, written by the previous step's sampler) and writes logits into a fixed buffer.

Transfers go through pinned host buffers and are asynchronous; a buffer goes back to its pool only
once the step that used it has been read back (which implies its copies finished).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.rollout.builtin.model import DecodeAttention, EngineModel, KVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Bucket sizes up to max_batch (which is always one, so every batch has a bucket)."""
    sizes = [b for b in DEFAULT_BUCKETS if b < max_batch]
    sizes += list(range(DEFAULT_BUCKETS[-1] + 128, max_batch, 128))
    return tuple(sorted(set(sizes))) + (max_batch,)


@dataclass
class StepInputs:
    """Host arrays of one decode step (length b each)."""

    slots: np.ndarray  # int64
    lengths: np.ndarray  # int64: tokens in the cache once this step's token is written
    seeds: np.ndarray  # int64: the noise seed of each row's new token
    temperatures: np.ndarray  # float32
    top_k: np.ndarray  # int64, -1: off
    top_p: np.ndarray  # float32


class HostBuffers:
    """A pool of same-shaped host buffers (pinned on CUDA so copies are asynchronous)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], pinned: bool) -> None:
        self.shapes, self.pinned = shapes, pinned
        self.free: deque[dict[str, Tensor]] = deque()

    def take(self) -> dict[str, Tensor]:
        if self.free:
            return self.free.popleft()
        return {
            name: torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
            for name, (shape, dtype) in self.shapes.items()
        }

    def give(self, buffers: dict[str, Tensor]) -> None:
        self.free.append(buffers)


class Readback:
    """A step's sampled tokens and logprobs on their way to the host."""

    def __init__(self, tokens: Tensor, logprobs: Tensor, pool: HostBuffers, staged: dict | None, h2d_pool):
        self.count = tokens.shape[0]
        self.pool, self.staged, self.h2d_pool = pool, staged, h2d_pool
        self.host = pool.take()
        self.host["tokens"][: self.count].copy_(tokens, non_blocking=True)
        self.host["logprobs"][: self.count].copy_(logprobs, non_blocking=True)
        self.event = None
        if tokens.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host["tokens"][: self.count].tolist()
        logprobs = self.host["logprobs"][: self.count].tolist()
        self.pool.give(self.host)
        if self.staged is not None:
            self.h2d_pool.give(self.staged)
        return tokens, logprobs


class DecodeRunner:
    """Owns the decode step's device buffers and, on CUDA, one captured graph per bucket."""

    def __init__(
        self,
        model: EngineModel,
        cache: KVCache,
        last_token: Tensor,
        attend: DecodeAttention,
        max_batch: int,
        capture_stream: torch.cuda.Stream | None,
        fused: bool = False,
    ) -> None:
        """capture_stream: the side stream its CUDA graphs are warmed up and captured on (None: no
        graphs); fused: the Triton decode path (EngineModel.decode_fused) rather than decode(attend=...)."""
        self.model, self.cache, self.last_token, self.attend = model, cache, last_token, attend
        self.fused = fused and model.can_fuse
        self.device = model.device
        self.max_batch = max_batch
        self.capture_stream = capture_stream
        self.use_graphs = capture_stream is not None
        self.buckets = graph_buckets(max_batch)
        cuda = self.device.type == "cuda"
        # rows: slots, lengths, seeds (int64); temperatures travel as a separate float32 row
        self.inputs = torch.zeros((3, max_batch), dtype=torch.int64, device=self.device)
        self.temperatures = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.logits = torch.empty((max_batch, model.shape.vocab), dtype=model.dtype, device=self.device)
        self.h2d = HostBuffers(
            {"ints": ((3, max_batch), torch.int64), "temps": ((max_batch,), torch.float32)}, pinned=cuda
        )
        self.d2h = HostBuffers(
            {"tokens": ((max_batch,), torch.int64), "logprobs": ((max_batch,), torch.float32)}, pinned=cuda
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The graphs' memory in a pool of their own: close() hands back exactly its blocks, so the engine
        # need not empty the whole allocator (and free the update's cached blocks) to reclaim them.
        self.pool = None
        if self.use_graphs:
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.MemPool()

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def stage(self, step: StepInputs) -> tuple[int, dict]:
        """Copy a step's inputs to the device buffers (padded to the bucket); returns (width, buffers)."""
        batch = len(step.slots)
        width = self.bucket(batch) if self.use_graphs else batch
        if self.use_graphs and width not in self.graphs:
            self._capture(width)  # before the copy below: capturing runs the step on padding inputs
        staged = self.h2d.take()
        ints, temps = staged["ints"].numpy(), staged["temps"].numpy()
        ints[0, :batch], ints[1, :batch], ints[2, :batch] = step.slots, step.lengths, step.seeds
        ints[0, batch:width], ints[1, batch:width], ints[2, batch:width] = self.cache.padding_slot, 1, 0
        temps[:batch] = step.temperatures
        for row in range(3):  # row by row: a strided pinned source would be copied through pageable memory
            self.inputs[row, :width].copy_(staged["ints"][row, :width], non_blocking=True)
        self.temperatures[:batch].copy_(staged["temps"][:batch], non_blocking=True)
        return width, staged

    def forward(self, batch: int, width: int) -> Tensor:
        """Logits [batch, V] of the staged step."""
        if not self.use_graphs:
            self._decode(width)
            return self.logits[:batch]
        self.graphs[width].replay()
        return self.logits[:batch]

    def _decode(self, width: int) -> None:
        slots, lengths = self.inputs[0, :width], self.inputs[1, :width]
        tokens, out = self.last_token[slots], self.logits[:width]
        if self.fused:
            self.model.decode_fused(tokens, slots, lengths, self.cache, out=out)
        else:
            self.model.decode(tokens, slots, lengths, self.cache, self.attend, out=out)

    def _capture(self, width: int) -> None:
        # Warm up on a side stream first (compiles Triton kernels, settles cuBLAS workspaces).
        self.inputs[0, :width] = self.cache.padding_slot
        self.inputs[1, :width] = 1
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._decode(width)
            side.synchronize()
            # Captured with capture_begin / capture_end, not torch.cuda.graph(): that synchronizes the
            # device and empties its memory cache and the pinned host cache at every capture, and the
            # engine captures its buckets again after each KV resume (13 in a training step's rollout),
            # so the pinned blocks the trainer's batches travel through were freed (~1,100 cudaFreeHost,
            # ~350 ms a step in a profile) and allocated again by the next update. A 1-GPU GRPO step's
            # generation took 0.89-0.91 s against 1.01 (bench/scaling.py, H200); the KV release, outside
            # it, hands back the graphs' pool instead (close).
            graph.capture_begin(pool=self.pool.id)
            try:
                self._decode(width)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.graphs[width] = graph

    def close(self) -> None:
        """Destroy the graphs, then their pool: a MemPool returns its unused blocks to the device when it
        goes, but only once no graph holds it. A fresh pool each phase: capturing into a pool again after
        its graphs are gone trips torch 2.11's pinned-host allocator (CachingHostAllocator's use_count)."""
        self.graphs.clear()
        self.pool = None

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (so smaller graphs reuse its memory pool)."""
        if self.use_graphs:
            for width in sorted(self.buckets, reverse=True):
                if width not in self.graphs:
                    self._capture(width)
