"""LocalReplica: the built-in engine in this process, answering the SGLang-API calls of rollout/protocol.py.

It is the core of the rollout server (whose routes only parse HTTP and call it) and, in the colocated
trainer, a replica of the pool like any HTTP one: the rollout manager cannot tell them apart, except that
weights reach it as tensors in memory instead of through a file or a socket.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from trainer.rollout.base import Rollout
from trainer.rollout.builtin import checkpoint_tensors
from trainer.rollout.builtin.engine import SequenceOutput
from trainer.rollout.builtin.worker import EngineError, EngineWorker
from trainer.rollout.client import ReplicaDown
from trainer.rollout.protocol import (
    SAFETENSORS_FORMAT,
    SGLANG_API_VERSION,
    GenerateItem,
    GenerateRequest,
    finish_reason,
    generate_items,
    logprob_entries,
    output_item,
)

DISK_FORMATS = (None, "auto", SAFETENSORS_FORMAT)


class LocalReplica:
    def __init__(
        self,
        worker: EngineWorker,
        tokenizer=None,
        *,
        model_path: str | None = None,
        name: str = "local",
        with_text: bool = True,
    ) -> None:
        """with_text: decode each output's text (SGLang always does; the trainer needs only the ids)."""
        self.worker, self.tokenizer = worker, tokenizer
        self.model_path = model_path
        self.name = name
        self.with_text = with_text and tokenizer is not None
        self.weight_version = "default"
        self.weight_groups: dict = {}  # group name -> torch process group (weight_group.py)

    @property
    def engine(self):
        return self.worker.engine

    async def generate(self, request: GenerateRequest | dict) -> list[dict]:
        """Every prompt's n samples, prompt-major (SGLang's batch order). ValueError: a bad request."""
        if not isinstance(request, GenerateRequest):
            request = GenerateRequest.model_validate(request)
        encode = None if self.tokenizer is None else self.tokenizer.encode
        items = generate_items(request, context_length=self.engine.config.context_length, encode=encode)
        started = time.perf_counter()
        try:
            results = await asyncio.gather(*(self._run(i) for i in items))
        except EngineError as exc:  # the engine, not the request, failed: the pool may retry elsewhere
            raise ReplicaDown(f"{self.name}: {exc}") from exc
        options = (bool(request.return_text_in_logprobs), bool(request.return_prompt_token_ids))
        latency = time.perf_counter() - started
        return [
            self._output(item, index, sample, input_logprobs, latency, options)
            for item, (samples, input_logprobs) in zip(items, results)
            for index, sample in enumerate(samples)
        ]

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        """One prompt's samples straight from the engine as Rollouts (the trainer's path: no SGLang
        output dicts to build and parse back)."""
        encode = None if self.tokenizer is None else self.tokenizer.encode
        request = GenerateRequest.model_validate(payload)
        (item,) = generate_items(request, context_length=self.engine.config.context_length, encode=encode)
        try:
            samples = await self.worker.generate(item.prompt, item.sampling, item.rid)
        except EngineError as exc:
            raise ReplicaDown(f"{self.name}: {exc}") from exc
        return [
            Rollout(
                prompt_ids=item.prompt,
                response_ids=sample.token_ids,
                logprobs=sample.logprobs,
                loss_mask=np.ones(len(sample.token_ids), dtype=np.int8),
                finish_reason=sample.finish_reason,
                prompt_index=prompt_index,
            )
            for sample in samples
        ]

    @property
    def dtype(self):
        """The engine's weights' dtype (what a weight sync casts to)."""
        return self.engine.model.dtype

    @property
    def capacity(self) -> int:
        """The most sequences the engine decodes at once (its KV slots' cap)."""
        return self.engine.config.max_running

    def load_weights_now(self, named_tensors: Mapping[str, Tensor]) -> None:
        """update_weights_from_tensor for a caller without an event loop (a rank's weight sync)."""
        self.worker.call_sync(self.engine.load_weights, named_tensors)

    async def _run(self, item: GenerateItem) -> tuple[list[SequenceOutput], list[list] | None]:
        """The item's samples, and its input logprob entries when asked (a forward of the prompt)."""
        input_logprobs = None
        if item.return_logprob:
            input_logprobs = await self._input_logprobs(item)
        if item.sampling is None:  # prefill only: SGLang answers no tokens, finish_reason length 0
            empty = SequenceOutput([], [], "length", 0, len(item.prompt))
            return [empty] * item.wire.n, input_logprobs
        return await self.worker.generate(item.prompt, item.sampling, item.rid), input_logprobs

    async def _input_logprobs(self, item: GenerateItem) -> list[list]:
        start, prompt = item.logprob_start, item.prompt
        if start >= len(prompt):
            return []
        values = await self.worker.call(self.engine.prompt_logprobs, prompt, item.wire.temperature)
        logprobs = [None, *values[start:]]  # SGLang: the first entry has no logprob, whatever the start
        return logprob_entries(logprobs, prompt[start:])

    def _output(self, item, index, sample: SequenceOutput, input_logprobs, latency, options) -> dict:
        with_text_logprobs, with_prompt_ids = options
        logprobs = sample.logprobs if item.return_logprob else None
        input_entries = input_logprobs
        if with_text_logprobs and logprobs is not None:
            input_entries = [[lp, tid, self._token_text(tid)] for lp, tid, _ in input_logprobs or []]
        return output_item(
            rid=item.output_ids[index],
            text=self._text(item, sample),
            output_ids=sample.token_ids,
            logprobs=logprobs,
            finish=finish_reason(sample.finish_reason, sample.matched),
            prompt_tokens=sample.prompt_tokens,
            weight_version=self.weight_version,
            e2e_latency=latency,
            output_texts=[self._token_text(t) for t in sample.token_ids] if with_text_logprobs else None,
            input_logprobs=input_entries,
            prompt_token_ids=list(item.prompt) if with_prompt_ids else None,
        )

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _text(self, item: GenerateItem, sample: SequenceOutput) -> str:
        if not self.with_text or not sample.token_ids:
            return ""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=item.wire.skip_special_tokens)
        if isinstance(sample.matched, str) and not item.wire.no_stop_trim and sample.matched in text:
            text = text[: text.index(sample.matched)]  # SGLang trims the stop string from the text
        return text

    # ------------------------------------------------------------------- requests in flight

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's /abort_request: finish the named request's (or every request's) samples now."""

        def abort() -> None:
            engine = self.engine
            rids = {r.rid for r in engine.waiting} | {s.request.rid for s in engine.running.values()}
            for each in rids if abort_all else {rid} & rids:
                engine.abort(each)

        await self.worker.call(abort)

    async def pause_generation(self, mode: str = "abort") -> None:
        """abort: abort what runs, then hold new requests; in_place / retract: hold everything where it
        is (the engine keeps its KV cache, so both resume exactly)."""
        if mode == "abort":
            await self.abort_request(abort_all=True)
        await self.worker.call(setattr, self.worker, "paused", True)

    async def continue_generation(self) -> None:
        await self.worker.call(setattr, self.worker, "paused", False)

    def load(self) -> dict:
        """Every core key of SGLang's LoadSnapshot (srt/managers/load_snapshot.py, 0.5.23) for its one DP
        rank, read without a lock (a hint). What this engine does not measure is 0: no throughput
        window, no prefix cache (cache_hit_rate), no disaggregation (prealloc tokens), no prefill
        timers; decode_moments is None, as SGLang sends it before its first decode step."""
        engine = self.engine
        running = len(engine.running)
        used = sum(len(s.request.prompt) + len(s.tokens) for s in list(engine.running.values()))
        waiting = list(engine.waiting)
        waiting_tokens = sum(len(r.prompt) * r.sampling.n for r in waiting)  # no prefix cache: all uncached
        total = engine.config.max_running * engine.config.context_length
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": sum(r.sampling.n for r in waiting),
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_tokens,  # SGLang: used plus what the queue will need
            "num_active_tokens": used + waiting_tokens,  # equal to it outside disaggregated decode
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": total,
            "max_running_requests": engine.config.max_running,
            "token_usage": round(used / total, 4) if total else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, weight_version: str | None = None
    ) -> None:
        """Load every *.safetensors of a checkpoint folder (the same architecture and shapes)."""
        if load_format not in DISK_FORMATS:
            raise ValueError(f"load_format {load_format!r} is not supported (use safetensors)")
        state = await asyncio.to_thread(lambda: dict(checkpoint_tensors(model_path)))
        await self.worker.call(lambda: self.engine.load_weights(state, strict=True))
        self.model_path = model_path
        self.weight_version = weight_version or self.weight_version

    async def update_weights_from_tensor(
        self, named_tensors: Mapping[str, Tensor], *, weight_version: str | None = None
    ) -> None:
        """Copy tensors in memory into the engine (a subset of the weights is fine)."""
        await self.worker.call(self.engine.load_weights, named_tensors)
        self.weight_version = weight_version or self.weight_version

    async def update_weights_from_serialized(
        self, payloads: Sequence[str], *, load_format: str | None, weight_version: str | None = None
    ) -> None:
        """/update_weights_from_tensor over HTTP: one base64 safetensors payload (TP size 1)."""
        if load_format != SAFETENSORS_FORMAT:
            raise ValueError(
                f"load_format must be {SAFETENSORS_FORMAT!r} (base64 safetensors bytes); this server cannot "
                "open SGLang's CUDA-IPC tensor handles"
            )
        if len(payloads) != 1:
            raise ValueError(f"expected 1 serialized payload (tensor parallel size 1), got {len(payloads)}")
        from safetensors.torch import load as load_safetensors

        try:
            tensors = load_safetensors(base64.b64decode(payloads[0], validate=True))
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's bad payload
            raise ValueError(f"serialized_named_tensors[0] is not base64 safetensors: {exc}") from exc
        await self.update_weights_from_tensor(tensors, weight_version=weight_version)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """None: everything. SGLang's "cuda_graph" tag is dropped: the graphs go with the KV cache here."""
        if (engine_tags := _engine_tags(tags)) != []:
            await self.worker.call(self.engine.release, engine_tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        if (engine_tags := _engine_tags(tags)) != []:
            await self.worker.call(self.engine.resume, engine_tags)

    async def flush_cache(self) -> None:
        """Nothing to flush: the engine keeps no prefix cache across requests."""

    async def health(self) -> bool:
        return True

    def model_info(self) -> dict:
        """SGLang's /get_model_info keys."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": getattr(self.tokenizer, "name_or_path", None),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "served_model_name": self.model_path,
        }

    def server_info(self) -> dict:
        """The /get_server_info keys SGLang's clients read (slime compares server args; routers read
        tp_size, dp_size, max_total_num_tokens; version gates features), then the engine's own."""
        engine = self.engine
        config = engine.config
        return {
            "version": SGLANG_API_VERSION,
            "model_path": self.model_path,
            "tokenizer_path": getattr(self.tokenizer, "name_or_path", None),
            "served_model_name": self.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "max_total_num_tokens": config.max_running * config.context_length,
            "max_running_requests": config.max_running,
            "max_prefill_tokens": config.max_prefill_tokens,
            "context_length": config.context_length,
            "enable_deterministic_inference": True,  # sampling_seed is always honoured here
            "enable_memory_saver": True,  # release/resume_memory_occupation work
            "internal_states": [
                {
                    "weight_version": self.weight_version,
                    "paused": self.worker.paused,
                    "num_running_reqs": len(engine.running),
                }
            ],
            "engine": "builtin",
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "cuda_graphs": engine.use_graphs,
            "triton_kernels": engine.fused,
            "released": sorted(engine.released),
            "waiting_sequences": sum(r.sampling.n for r in engine.waiting),
            "running_sequences": len(engine.running),
        }

    # ------------------------------------------------------------------- the distributed weight group

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's broadcast group as rank rank_offset (this server is one TP rank)."""
        from trainer.rollout.weight_group import init_weight_group

        if group_name in self.weight_groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        self.weight_groups[group_name] = await asyncio.to_thread(
            init_weight_group,
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank=rank_offset,
            group_name=group_name,
            backend=backend,
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        import torch.distributed as dist

        if group_name not in self.weight_groups:
            raise ValueError(f"no weight update group {group_name!r}")
        await asyncio.to_thread(dist.destroy_process_group, self.weight_groups.pop(group_name))

    async def update_weights_from_distributed(
        self, *, names, dtypes, shapes, group_name: str, weight_version: str | None = None
    ) -> None:
        """Receive the broadcast (off the engine thread), then load it between engine steps."""
        from trainer.rollout.weight_group import receive_weights

        if group_name not in self.weight_groups:
            raise ValueError(f"no weight update group {group_name!r}: call /init_weights_update_group first")
        device = "cpu" if self.engine.device.type == "cpu" else self.engine.device
        tensors = await asyncio.to_thread(
            receive_weights, self.weight_groups[group_name], names, dtypes, shapes, device
        )
        await self.update_weights_from_tensor(tensors, weight_version=weight_version)

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close)


def _engine_tags(tags: Sequence[str] | None) -> list[str] | None:
    """SGLang's memory tags as the engine takes them: None stays None (all); "cuda_graph" is no region
    of its own here, so a list of only that becomes [] (nothing to do)."""
    if tags is None:
        return None
    return [tag for tag in tags if tag != "cuda_graph"]
