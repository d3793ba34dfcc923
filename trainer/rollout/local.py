"""LocalReplica: the built-in engine in this process, answering the SGLang-API calls of rollout/protocol.py.

It is the core of the rollout server (whose routes only parse HTTP and call it) and, in the colocated
trainer, a replica of the pool like any HTTP one: the rollout manager cannot tell them apart, except that
weights reach it as tensors in memory instead of through a file or a socket.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Mapping, Sequence

from torch import Tensor

from trainer.rollout.base import Rollout
from trainer.rollout.builtin import checkpoint_tensors
from trainer.rollout.builtin.engine import SequenceOutput
from trainer.rollout.builtin.worker import EngineError, EngineWorker
from trainer.rollout.client import ReplicaDown
from trainer.rollout.protocol import (
    SAFETENSORS_FORMAT,
    GenerateItem,
    GenerateRequest,
    finish_reason,
    generate_items,
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

    @property
    def engine(self):
        return self.worker.engine

    async def generate(self, request: GenerateRequest | dict) -> list[dict]:
        """Every prompt's n samples, prompt-major (SGLang's batch order). ValueError: a bad request."""
        if not isinstance(request, GenerateRequest):
            request = GenerateRequest.model_validate(request)
        items = generate_items(request)
        started = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(self.worker.generate(i.prompt, i.sampling, i.rid) for i in items)
            )
        except EngineError as exc:  # the engine, not the request, failed: the pool may retry elsewhere
            raise ReplicaDown(f"{self.name}: {exc}") from exc
        outputs = []
        for item, samples in zip(items, results):
            for index, sample in enumerate(samples):
                outputs.append(self._output(item, index, sample, time.perf_counter() - started))
        return outputs

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        """One prompt's samples straight from the engine as Rollouts (the trainer's path: no SGLang
        output dicts to build and parse back)."""
        (item,) = generate_items(GenerateRequest.model_validate(payload))
        try:
            samples = await self.worker.generate(item.prompt, item.sampling, item.rid)
        except EngineError as exc:
            raise ReplicaDown(f"{self.name}: {exc}") from exc
        return [
            Rollout(
                prompt_ids=list(item.prompt),
                response_ids=sample.token_ids,
                logprobs=sample.logprobs,
                loss_mask=[1] * len(sample.token_ids),
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

    def _output(self, item: GenerateItem, index: int, sample: SequenceOutput, latency: float) -> dict:
        rid = item.rid or uuid.uuid4().hex
        if item.sampling.n > 1:
            rid = f"{rid}-{index}"
        return output_item(
            rid=rid,
            text=self._text(item, sample),
            output_ids=sample.token_ids,
            logprobs=sample.logprobs if item.return_logprob else None,
            finish=finish_reason(sample.finish_reason, sample.matched),
            prompt_tokens=sample.prompt_tokens,
            weight_version=self.weight_version,
            e2e_latency=latency,
        )

    def _text(self, item: GenerateItem, sample: SequenceOutput) -> str:
        if not self.with_text:
            return ""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=item.wire.skip_special_tokens)
        if isinstance(sample.matched, str) and not item.wire.no_stop_trim and sample.matched in text:
            text = text[: text.index(sample.matched)]  # SGLang trims the stop string from the text
        return text

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
        await self.worker.call(self.engine.release, tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.worker.call(self.engine.resume, tags)

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
        engine = self.engine
        config = engine.config
        return {
            "engine": "builtin",
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "max_running_requests": config.max_running,
            "context_length": config.context_length,
            "cuda_graphs": engine.use_graphs,
            "triton_kernels": engine.fused,
            "released": sorted(engine.released),
            "waiting_sequences": sum(r.sampling.n for r in engine.waiting),
            "running_sequences": len(engine.running),
        }

    async def close(self) -> None:
        await asyncio.to_thread(self.worker.close)
