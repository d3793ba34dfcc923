"""The built-in rollout engine: continuous batching over a slotted KV cache.

    waiting requests --admit (free slots, prefill token budget)--> one prefill per prompt, KV copied to
    its n samples' slots, first token sampled --> running sequences --decode step--> ... --> finished

Each `step()` admits what fits, launches one decode step for every running sequence, and then reads
back the results of the step before it: the host never waits for the GPU step it just launched, so
bookkeeping (stop tokens, stop strings, lengths) overlaps the next forward. The price is that a
sequence that hit a stop token runs one wasted step before the host learns of it; its extra token is
dropped. Sequences join and leave between steps, so a finished sequence frees its slot for a waiting
prompt at once and no request waits for the slowest sequence of another.

Two paths, one scheduler: on CUDA (with Triton) decode attention and sampling are Triton kernels and
each decode step is a CUDA-graph replay; on CPU the same steps run eagerly in plain torch.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from trainer.batch import to_device
from trainer.rollout.base import FinishReason, SamplingParams
from trainer.rollout.builtin import kernels
from trainer.rollout.builtin.memory import describe, device_memory, kv_slots
from trainer.rollout.builtin.model import EngineModel, KVCache, rms_norm, torch_decode_attention
from trainer.rollout.builtin.runner import DecodeRunner, Readback, StepInputs
from trainer.rollout.builtin.sampler import needs_floor, sample, sampling_floors, token_seeds

log = logging.getLogger("trainer.rollout")

MEMORY_TAGS = ("weights", "kv_cache")  # SGLang's names for what release/resume_memory_occupation frees


class EngineStateError(RuntimeError):
    """The call conflicts with the engine's state (e.g. generating while its memory is released)."""


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 256  # KV slots: the most sequences decoded together (the cap when sized by memory)
    context_length: int = 4096  # prompt + response tokens one slot holds
    max_prefill_tokens: int = 16384  # padded prompt tokens per prefill forward (one long prompt may exceed)
    cuda_graphs: bool = True  # capture decode steps (CUDA + Triton only)
    # CUDA: size the slots so that weights + KV cache take at most this fraction of the GPU and fit in
    # what is free when the cache is allocated (memory.py); None: exactly max_running slots
    gpu_memory_utilization: float | None = None
    # release() leaves the cache's memory in this process's caching allocator, where a colocated update's
    # passes reuse it instead of ~300 cudaMallocs while the GPU idles, and resume() takes the cache back
    # from the allocator's blocks: no empty_cache at either end, whose cudaFrees serialise across a host's
    # processes (0.04 s a resume at 1 GPU, 0.17-0.21 s at 4; BENCHMARKS.md, 2026-11-29). The graphs' own
    # pool goes back to the device at release (DecodeRunner.close). False: release hands all the memory
    # back to the device, for other processes on this GPU.
    keep_released_memory: bool = False


@dataclass
class SequenceOutput:
    """One finished sample: what SGLang returns as output_ids, output_token_logprobs and finish_reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    matched: int | str | None  # the stop token id or stop string; max_new_tokens for "length"
    prompt_tokens: int


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    on_done: Callable[[list[SequenceOutput]], None] | None
    seqs: list[_Seq] = field(default_factory=list)
    outputs: list[SequenceOutput] | None = None


@dataclass(eq=False)
class _Seq:
    request: _Request
    base_seed: int
    stop_ids: frozenset[int]
    slot: int = -1
    launched: int = 0  # tokens whose computation has been launched (sampled or in flight)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: tuple[FinishReason, int | str | None] | None = None

    @property
    def max_new(self) -> int:
        return self.request.sampling.max_new_tokens


@dataclass(eq=False)
class _Launch:
    rows: list[_Seq]
    readback: Readback


class BuiltinEngine:
    """Continuous-batching generation on one device. Not thread-safe: drive it from one thread
    (EngineWorker does, for async callers)."""

    def __init__(
        self,
        model: EngineModel,
        tokenizer=None,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """tokenizer: needed only for stop strings. eos_token_ids: stop every sequence (unless ignore_eos)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = model.device
        self.fused = kernels.triton_available(self.device)
        if self.fused and (problem := kernels_self_check(self.device, model.dtype)) is not None:
            log.warning(
                f"Triton kernels failed their self-check ({problem}); decoding on the plain torch path"
            )
            self.fused = False
        self.use_graphs = self.config.cuda_graphs and self.device.type == "cuda" and self.fused
        # One side stream for every capture, phase after phase: cuBLAS keeps a workspace for each stream
        # it has run on (32 MiB on Hopper, not freed by empty_cache), and a new stream a capture took a
        # new one from torch's pool of streams until it had cycled through all 32 (+1 GiB reserved).
        self.capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Seq] = {}  # id(seq) -> seq, in admission order
        self.pending: deque[_Launch] = deque()
        self.released: set[str] = set()
        self._rows: list[_Seq] = []
        self._inputs: StepInputs | None = None
        self._allocate()

    # ------------------------------------------------------------------------------------ public

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    def add(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        on_done: Callable[[list[SequenceOutput]], None] | None = None,
        rid: str | None = None,
    ) -> str:
        """Queue one prompt for sampling.n samples; on_done(outputs) runs when all of them finished."""
        if self.released:
            raise EngineStateError(
                f"memory is released ({', '.join(sorted(self.released))}); resume_memory_occupation first"
            )
        self._check(prompt, sampling)
        request = _Request(rid or uuid.uuid4().hex, list(prompt), sampling, on_done)
        base = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else self.eos_token_ids
        )
        request.seqs = [
            _Seq(request, int(token_seeds(np.array([base]), np.array([-1 - j]))[0]), stop_ids)
            for j in range(sampling.n)
        ]
        self.waiting.append(request)
        return request.rid

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[SequenceOutput]]:
        """Run prompts to completion (synchronously); outputs[i] are prompt i's n samples."""
        requests = []
        for prompt in prompts:
            self.add(prompt, sampling)
            requests.append(self.waiting[-1])
        while any(r.outputs is None for r in requests):
            self.step()
        return [r.outputs for r in requests]

    def abort(self, rid: str) -> bool:
        """Finish a request's sequences now with finish_reason "abort"; False if it is unknown."""
        seqs = [s for r in self.waiting if r.rid == rid for s in r.seqs]
        self.waiting = deque(r for r in self.waiting if r.rid != rid)
        seqs += [s for s in self.running.values() if s.request.rid == rid]
        for seq in seqs:
            self._finish(seq, "abort", "aborted by the caller")
        return bool(seqs)

    def prompt_logprobs(self, prompt: Sequence[int], temperature: float = 1.0) -> list[float]:
        """log p(prompt[t] | prompt[:t]) for t in 1..len-1, under log_softmax(logits / temperature) as
        the sampled tokens' logprobs are (temperature 0: the untempered model). One forward, no slot."""
        if "weights" in self.released:
            raise EngineStateError("weights are released; resume_memory_occupation first")
        self._check(prompt, SamplingParams(max_new_tokens=1))
        tokens = torch.tensor(list(prompt), device=self.device)
        logits = self.model.prompt_logits(tokens)[:-1].float()
        if temperature > 0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[1:, None])[:, 0].tolist()

    def step(self) -> None:
        """Admit, launch one decode step, read back everything but the newest launch."""
        if self.released:
            raise EngineStateError(f"memory is released ({', '.join(sorted(self.released))}); resume first")
        self._admit()
        rows = [s for s in self.running.values() if s.finish is None and s.launched < s.max_new]
        if rows:
            self._launch_decode(rows)
        keep = 1 if rows else 0
        while len(self.pending) > keep:
            self._process(self.pending.popleft())

    def reset(self, reason: str) -> None:
        """Drop every request (after an error), telling each caller why."""
        self.pending.clear()
        for request in list(self.waiting):
            for seq in request.seqs:
                self._finish(seq, "abort", reason)
        self.waiting.clear()
        for seq in list(self.running.values()):
            self._finish(seq, "abort", reason)
        self._rows = []

    # ------------------------------------------------------------------------------------ weights, memory

    def load_weights(self, state: Mapping[str, Tensor], *, strict: bool = False) -> int:
        """Copy transformers-named weights into the engine (in place: captured graphs stay valid).

        A subset is fine (weight sync in buckets); unknown names and wrong shapes are errors; strict:
        every weight must be given (a whole checkpoint)."""
        if "weights" in self.released:
            raise EngineStateError("weights are released; resume_memory_occupation(['weights']) first")
        return self.model.load(state, strict=strict)

    def release(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory: "kv_cache" (cache + graphs) and/or "weights" (moved to host memory)."""
        tags = set(tags or MEMORY_TAGS)
        unknown = tags - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
        if self.waiting or self.running:
            raise EngineStateError("cannot release memory while requests are running")
        # Every request may be done while the newest launch is still pending: a step launches before it
        # reads back the launch whose tokens finish the last sequences. Its output is a wasted token, but
        # the GPU may still be writing the cache: wait for it before the memory goes.
        while self.pending:
            self._process(self.pending.popleft())
        if self.runner is not None:
            self.runner.close()
        self.runner = self.cache = self.last_token = None
        self._rows, self._inputs = [], None
        if "weights" in tags and "weights" not in self.released:
            self.model.move_to(torch.device("cpu"), pin=self.device.type == "cuda")
        self.released |= tags | {"kv_cache"}  # the graphs read the weights' addresses: both go
        if self.device.type == "cuda" and not (self.config.keep_released_memory and "weights" not in tags):
            torch.cuda.empty_cache()

    def resume(self, tags: Sequence[str] | None = None) -> None:
        tags = set(tags or MEMORY_TAGS)
        if "weights" in tags and "weights" in self.released:
            self.model.move_to(self.device)
            self.released.discard("weights")
        if "kv_cache" in tags and "weights" not in self.released and "kv_cache" in self.released:
            self._allocate()
            self.released.discard("kv_cache")

    # ------------------------------------------------------------------------------------ internals

    def _allocate(self) -> None:
        cfg = self.config
        self.max_running = self._slot_count()
        self.cache = KVCache(
            self.model.shape, self.max_running, cfg.context_length, self.model.dtype, self.device
        )
        self.last_token = torch.zeros(self.max_running + 1, dtype=torch.int64, device=self.device)
        attend = kernels.decode_attention if self.fused else torch_decode_attention
        self.runner = DecodeRunner(
            self.model,
            self.cache,
            self.last_token,
            attend,
            self.max_running,
            self.capture_stream,
            fused=self.fused,
        )
        self.free_slots = list(range(self.max_running - 1, -1, -1))

    def _slot_count(self) -> int:
        """config.max_running, or as many slots as gpu_memory_utilization and the free memory allow."""
        cfg = self.config
        if cfg.gpu_memory_utilization is None or self.device.type != "cuda":
            return cfg.max_running
        memory = device_memory(self.device)
        weights = self.model.nbytes
        slots = kv_slots(
            self.model.shape,
            context=cfg.context_length,
            dtype=self.model.dtype,
            memory=memory,
            utilization=cfg.gpu_memory_utilization,
            weights_bytes=weights,
            max_prefill_tokens=cfg.max_prefill_tokens,
            cap=cfg.max_running,
        )
        if slots < 1:
            raise EngineStateError(
                f"no room for a KV cache of {cfg.context_length}-token slots ("
                f"{describe(memory, cfg.gpu_memory_utilization, weights)}): raise "
                "rollout.gpu_memory_utilization, shorten the context or free GPU memory"
            )
        log.info(
            "KV cache: %d slots of %d tokens (%s)",
            slots,
            cfg.context_length,
            describe(memory, cfg.gpu_memory_utilization, weights),
        )
        return slots

    def warmup(self) -> None:
        """Capture every CUDA-graph bucket now rather than at first use."""
        self.runner.capture_all()

    def _check(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        cfg, vocab = self.config, self.model.shape.vocab
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + sampling.max_new_tokens > cfg.context_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"engine's context length {cfg.context_length}"
            )
        if sampling.n > self.max_running:
            raise ValueError(f"n={sampling.n} exceeds the engine's max_running={self.max_running}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

    def _admit(self) -> None:
        admitted: list[_Request] = []
        width = 0
        while self.waiting:
            request = self.waiting[0]
            if len(self.free_slots) < request.sampling.n:
                break
            new_width = max(width, len(request.prompt))
            if admitted and (len(admitted) + 1) * new_width > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            width = new_width
            for seq in request.seqs:
                seq.slot = self.free_slots.pop()
                self.running[id(seq)] = seq
            admitted.append(request)
        if admitted:
            self._launch_prefill(admitted, width)

    def _launch_prefill(self, requests: list[_Request], width: int) -> None:
        prompts = np.zeros((len(requests), width), dtype=np.int64)
        for row, request in enumerate(requests):
            prompts[row, : len(request.prompt)] = request.prompt
        siblings = [(r.seqs[0].slot, s.slot) for r in requests for s in r.seqs[1:]]
        rows = [s for r in requests for s in r.seqs]
        inputs = _inputs_of(rows)
        inputs.seeds = token_seeds(inputs.seeds, np.zeros(len(rows), dtype=np.int64))
        ints = [
            prompts,
            np.array([len(r.prompt) for r in requests], dtype=np.int64),  # lengths
            np.array([r.seqs[0].slot for r in requests], dtype=np.int64),  # each prompt's first slot
            np.array([i for i, r in enumerate(requests) for _ in r.seqs], dtype=np.int64),  # row -> prompt
            inputs.seeds,
            inputs.slots,
            *(np.array(column, dtype=np.int64) for column in zip(*siblings)),  # prefix copies: src, dst
        ]
        tokens, lengths, first, expand, seeds, slots, *copies = upload(ints, self.device)
        (temperatures,) = upload([inputs.temperatures], self.device)
        prefill = self.model.prefill_fused if self.runner.fused else self.model.prefill
        logits = prefill(tokens, lengths, first, self.cache)
        if copies:
            self.cache.copy_prefix(*copies, width)
        if len(rows) > len(requests):
            logits = logits[expand]
        self._sample_and_read(rows, logits, inputs, (temperatures, seeds, slots), staged=None)

    def _step_inputs(self, rows: list[_Seq]) -> StepInputs:
        """Inputs of a decode step; rebuilt only when the batch's sequences changed since the last one."""
        if (
            self._inputs is not None
            and len(rows) == len(self._rows)
            and all(a is b for a, b in zip(rows, self._rows))
        ):
            self._inputs.lengths += 1
        else:
            self._rows = rows
            self._inputs = _inputs_of(rows)
            self._prompt_lengths = np.array([len(s.request.prompt) for s in rows], dtype=np.int64)
            self._base_seeds = self._inputs.seeds.copy()
        self._inputs.seeds = token_seeds(self._base_seeds, self._inputs.lengths - self._prompt_lengths)
        return self._inputs

    def _launch_decode(self, rows: list[_Seq]) -> None:
        inputs = self._step_inputs(rows)
        width, staged = self.runner.stage(inputs)
        logits = self.runner.forward(len(rows), width)
        batch, runner = len(rows), self.runner
        on_device = runner.temperatures[:batch], runner.inputs[2, :batch], runner.inputs[0, :batch]
        self._sample_and_read(rows, logits, inputs, on_device, staged)

    def _sample_and_read(
        self, rows: list[_Seq], logits: Tensor, inputs: StepInputs, on_device: tuple, staged
    ) -> None:
        """on_device: the step's temperatures, seeds and slots, already on the device."""
        temperatures, seeds, slots = on_device
        floors = self._floors(inputs, logits, temperatures)
        tokens, logprobs = sample(
            logits,
            temperatures,
            seeds,
            floors,
            slots,
            self.last_token,
            fused=self.fused,
            all_greedy=not inputs.temperatures.any(),
        )
        self.pending.append(
            _Launch(rows, Readback(tokens, logprobs, self.runner.d2h, staged, self.runner.h2d))
        )
        for seq in rows:
            seq.launched += 1

    def _floors(self, inputs: StepInputs, logits: Tensor, temperatures: Tensor) -> Tensor | None:
        if not needs_floor(inputs.top_k, inputs.top_p, self.model.shape.vocab):
            return None
        (top_k,), (top_p,) = upload([inputs.top_k], self.device), upload([inputs.top_p], self.device)
        return sampling_floors(logits, temperatures, top_k, top_p)

    def _process(self, launch: _Launch) -> None:
        tokens, logprobs = launch.readback.result()
        for seq, token, logprob in zip(launch.rows, tokens, logprobs):
            if seq.finish is not None:  # stopped a step earlier (or aborted): a wasted step
                continue
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if token in seq.stop_ids:
                self._finish(seq, "stop", token)
            elif seq.request.sampling.stop and (matched := self._stop_string(seq)) is not None:
                self._finish(seq, "stop", matched)
            elif len(seq.tokens) >= seq.max_new:
                self._finish(seq, "length", seq.max_new)

    def _stop_string(self, seq: _Seq) -> str | None:
        """The stop string the newest token completes, if any (decoding a short window of tokens:
        every token is at least one byte, so longest-stop-in-bytes + 1 tokens hold any match)."""
        stops = seq.request.sampling.stop
        window = max(len(s.encode()) for s in stops) + 1
        text = self.tokenizer.decode(seq.tokens[-window:], skip_special_tokens=False)
        return next((s for s in stops if s in text), None)

    def _finish(self, seq: _Seq, reason: FinishReason, matched: int | str | None) -> None:
        seq.finish = (reason, matched)
        if self.running.pop(id(seq), None) is not None:
            self.free_slots.append(seq.slot)
        request = seq.request
        if all(s.finish is not None for s in request.seqs) and request.outputs is None:
            request.outputs = [
                SequenceOutput(s.tokens, s.logprobs, s.finish[0], s.finish[1], len(request.prompt))
                for s in request.seqs
            ]
            if request.on_done is not None:
                request.on_done(request.outputs)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """Host arrays of one dtype on the device, in one copy that does not wait. On CUDA it goes through
    pinned memory: a copy from pageable memory first waits for all the GPU's queued work, here the decode
    steps in flight when a multi-turn request's next turn is admitted (or every step, for top-k/top-p)."""
    flat = to_device(torch.from_numpy(np.concatenate([a.ravel() for a in arrays])), device)
    return [part.view(a.shape) for part, a in zip(flat.split([a.size for a in arrays]), arrays)]


def _inputs_of(rows: list[_Seq]) -> StepInputs:
    """Host inputs of a step over `rows` (seeds: each sequence's base seed, mixed per token by the caller)."""
    params = [s.request.sampling for s in rows]
    return StepInputs(
        slots=np.array([s.slot for s in rows], dtype=np.int64),
        lengths=np.array([len(s.request.prompt) + s.launched for s in rows], dtype=np.int64),
        seeds=np.array([s.base_seed for s in rows], dtype=np.int64),
        temperatures=np.array([p.temperature for p in params], dtype=np.float32),
        top_k=np.array([p.top_k for p in params], dtype=np.int64),
        top_p=np.array([p.top_p for p in params], dtype=np.float32),
    )


def kernels_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Compile and run every kernel once on small inputs against plain torch; None if all agree, else
    what failed. The engine falls back to the plain path rather than decode with a broken kernel."""
    try:
        gen = torch.Generator().manual_seed(0)
        x, weight = (torch.randn(s, generator=gen).to(device, dtype) for s in ((3, 64), (64,)))
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        if not torch.allclose(
            kernels.add_rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), atol=tol, rtol=tol
        ):
            return "add_rms_norm disagrees with torch"
        k, v = (torch.randn(4, 2, 160, 16, generator=gen).to(device, dtype) for _ in range(2))
        q = torch.randn(3, 4, 16, generator=gen).to(device, dtype)
        slots, lengths = torch.tensor([0, 2, 3], device=device), torch.tensor([1, 70, 160], device=device)
        expected = torch_decode_attention(q, k, v, slots, lengths)
        for splits in (1, 2):
            if not torch.allclose(
                kernels.decode_attention(q, k, v, slots, lengths, splits), expected, atol=tol, rtol=tol
            ):
                return f"decode_attention ({splits} splits) disagrees with torch"
        logits = torch.randn(3, 300, generator=gen).to(device, dtype)
        temps = torch.tensor([0.0, 1.0, 0.5], device=device)
        tokens, logprobs = kernels.fused_sample(
            logits,
            temps,
            torch.arange(3, device=device),
            None,
            slots,
            torch.zeros(4, dtype=torch.long, device=device),
        )
        if int(tokens[0]) != int(logits[0].float().argmax()):
            return "fused_sample's greedy row is not the argmax"
        scaled = logits.float() / torch.where(temps == 0, 1.0, temps)[:, None]
        reference = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)
        if not torch.allclose(logprobs, reference, atol=1e-3):
            return "fused_sample's logprobs disagree with torch"
        qkv = torch.randn(3, 8 * 16, generator=gen).to(device, dtype)
        table = torch.randn(160, 16, generator=gen).to(device, dtype)
        rotated = kernels.rope_and_cache(qkv, table, table, slots, lengths, k, v, 4, 2)
        if (
            not torch.equal(v[slots, :, lengths - 1], qkv[:, 6 * 16 :].view(3, 2, 16))
            or not rotated.isfinite().all()
        ):
            return "rope_and_cache did not write the cache"
        kernels.silu_mul(torch.randn(3, 64, generator=gen).to(device, dtype))
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure means: do not use the kernels
        return f"{type(exc).__name__}: {exc}"
    return None
