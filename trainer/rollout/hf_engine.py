"""The transformers rollout engine (rollout.name=hf): batched sampling from a causal LM with a KV cache.

Its own decoding loop rather than `model.generate`, so that it controls exactly what the trainer needs:
the logprob of each sampled token under log_softmax(logits / temperature) (see rollout/base.py), stops
on token ids and on stop strings, and the finish reason of each response.

Prompts are left-padded into one batch (position ids count real tokens only, as the trainer's teacher-
forced forward does), each distinct prompt is run once to fill the cache (its n samples share that
prefill), then one token per step for every unfinished row. A response ends right after the token that
is a stop token id (eos and im_end by default) or that completes a stop string; that token is kept and
trained on, so the policy learns to stop. Rows that finished keep being fed padding until the whole
batch is done: simple and correct, a reference for the built-in engine (trainer/rollout/builtin/), which
batches continuously. A policy rank's copy (trainer/workers/engines.py) is its own bf16 model on GPU,
given the policy's weights after each update (`HFReplica.load_weights_now`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.builtin import default_eos_ids
from trainer.rollout.builtin.sampler import needs_floor, sampling_floors, token_seeds, torch_sample


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """Prompts -> (input_ids [B, P], attention_mask [B, P]) padded on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def shared_prefixes(rows: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[int], Tensor]:
    """(first row of each run of rows with the same prompt, the run index of every row).

    rows of one prompt are consecutive (n samples each), so prefilling `unique` and selecting
    `expand` from the results gives every row its prompt's cache and next-token logits.
    """
    unique: list[int] = []
    expand: list[int] = []
    for row, (index, _) in enumerate(rows):
        if not unique or rows[unique[-1]][0] != index:
            unique.append(row)
        expand.append(len(unique) - 1)
    return unique, torch.tensor(expand, dtype=torch.long)


def row_base_seeds(prompt_seeds: Sequence[int | None], n: int) -> np.ndarray:
    """The base seed of every row (n samples per prompt, consecutive), as the built-in engine derives
    them: sample j of a prompt seeded s draws from token_seeds(s, -1 - j); an unseeded prompt's samples
    draw their bases from torch's global RNG (which checkpoints save and restore)."""
    bases = []
    for seed in prompt_seeds:
        if seed is None:
            bases += [int(torch.randint(0, 2**62, ()).item()) for _ in range(n)]
        else:
            bases += token_seeds(np.full(n, seed, dtype=np.int64), -1 - np.arange(n)).tolist()
    return np.array(bases, dtype=np.int64)


class HFRolloutEngine:
    """Built-in engine on a transformers causal LM (CPU or one GPU)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        """max_batch_size: sequences decoded together (None = all); bounds the KV cache's memory."""
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_batch_size = max_batch_size
        self.eos_token_ids = (
            tuple(eos_token_ids) if eos_token_ids is not None else default_eos_ids(model, tokenizer)
        )
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; logits_to_keep avoids [B, P, V] prefill logits
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._keeps_last_logits = "logits_to_keep" in parameters

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Rollout]:
        """n samples of every prompt. seeds: one per prompt (default: sampling.seed for each). A row's
        noise depends only on its seed and token index (the built-in engine's rule, trainer/rollout/
        builtin/sampler.py), so a prompt samples the same tokens in any batch, up to the forward's
        numerics."""
        self._check_prompts(prompt_ids)
        seeds = [sampling.seed] * len(prompt_ids) if seeds is None else list(seeds)
        bases = row_base_seeds(seeds, sampling.n)
        rows = [(index, prompt) for index, prompt in enumerate(prompt_ids) for _ in range(sampling.n)]
        chunk = self.max_batch_size or len(rows)
        was_training = self.model.training
        self.model.eval()  # no dropout, no gradient checkpointing while sampling
        try:
            rollouts: list[Rollout] = []
            for start in range(0, len(rows), chunk):
                rollouts += self._generate_rows(
                    rows[start : start + chunk], sampling, bases[start : start + chunk]
                )
            return rollouts
        finally:
            self.model.train(was_training)

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        for index, prompt in enumerate(prompt_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache) -> Tensor:
        kwargs = {self._cache_kwarg: cache}
        if self._keeps_last_logits:
            kwargs["logits_to_keep"] = 1
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return output.logits[:, -1].float()

    @torch.no_grad()
    def _generate_rows(
        self, rows: list[tuple[int, list[int]]], sampling: SamplingParams, bases: np.ndarray
    ) -> list[Rollout]:
        device = self.device
        # The n samples of a prompt are consecutive rows: run each distinct prompt through the model once
        # and copy its KV cache to its samples, instead of n identical prefills.
        unique, expand = shared_prefixes(rows)
        input_ids, attention_mask = left_pad([rows[i][1] for i in unique], self.pad_id, device)
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # real tokens only, 0 on the padding
        eos = () if sampling.ignore_eos else self.eos_token_ids
        stop_ids = torch.tensor(
            sorted(set(eos) | set(sampling.stop_token_ids)), dtype=torch.long, device=device
        )
        finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
        lengths = torch.full((len(rows),), sampling.max_new_tokens, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        cache = DynamicCache()
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        if len(unique) < len(rows):
            expand = expand.to(device)
            cache.batch_select_indices(expand)
            logits, attention_mask, position_ids = (
                logits[expand],
                attention_mask[expand],
                position_ids[expand],
            )
        temperatures = torch.full((len(rows),), float(sampling.temperature), device=device)
        top_k = torch.full((len(rows),), sampling.top_k, dtype=torch.long, device=device)
        top_p = torch.full((len(rows),), float(sampling.top_p), device=device)
        truncates = not sampling.greedy and needs_floor(
            np.array([sampling.top_k]), np.array([sampling.top_p]), logits.shape[-1]
        )
        for step in range(sampling.max_new_tokens):
            floors = sampling_floors(logits, temperatures, top_k, top_p) if truncates else None
            seeds = torch.from_numpy(token_seeds(bases, np.full(len(rows), step)))
            token, logprob = torch_sample(logits.float(), temperatures, seeds, floors)
            token = torch.where(finished, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(logprob)
            stops = ~finished & torch.isin(token, stop_ids)
            if sampling.stop:
                stops |= self._completes_stop_string(tokens, ~finished & ~stops, sampling.stop)
            lengths = torch.where(stops, step + 1, lengths)
            finished |= stops
            if bool(finished.all()) or step + 1 == sampling.max_new_tokens:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
            logits = self._forward(token[:, None], attention_mask, position_ids, cache)
        del cache
        return self._to_rollouts(
            rows, torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), lengths, finished
        )

    def _completes_stop_string(
        self, tokens: list[Tensor], candidates: Tensor, stop: tuple[str, ...]
    ) -> Tensor:
        """True for candidate rows whose newest token completes a stop string.

        Each token is at least one byte, so a window of (longest stop in bytes + 1) tokens holds any
        stop string that ends at the newest token; an earlier occurrence would have stopped the row.
        """
        hits = torch.zeros_like(candidates)
        rows = candidates.nonzero().squeeze(-1).tolist()
        if not rows:
            return hits
        window = max(len(s.encode()) for s in stop) + 1
        recent = torch.stack(tokens[-window:], dim=1)[rows].tolist()
        texts = self.tokenizer.batch_decode(recent, skip_special_tokens=False)
        for row, text in zip(rows, texts):
            hits[row] = any(s in text for s in stop)
        return hits

    @staticmethod
    def _to_rollouts(
        rows, tokens: Tensor, logprobs: Tensor, lengths: Tensor, stopped: Tensor
    ) -> list[Rollout]:
        rollouts = []
        for (prompt_index, prompt), row_tokens, row_logprobs, length, row_stopped in zip(
            rows, tokens.tolist(), logprobs.float().tolist(), lengths.tolist(), stopped.tolist()
        ):
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt),
                    response_ids=row_tokens[:length],
                    logprobs=row_logprobs[:length],
                    loss_mask=[1] * length,
                    finish_reason="stop" if row_stopped else "length",
                    prompt_index=prompt_index,
                )
            )
        return rollouts


class HFReplica:
    """An HFRolloutEngine as a replica of the rollout manager (a policy rank's `hf` engine).

    The manager sends one request per prompt; the replica runs the requests that arrive together with
    the same sampling settings as one batched generate (in a thread, off the event loop), each request
    with its own seed: what a request samples does not depend on which others share its batch.
    """

    def __init__(self, engine: HFRolloutEngine, *, name: str = "hf") -> None:
        self.engine, self.name = engine, name
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._draining: asyncio.Task | None = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.engine.model.parameters()).dtype

    capacity = None  # no KV slots to fill: every request may be sent at once

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        from trainer.rollout.protocol import GenerateRequest, generate_items

        context = self.engine.model.config.max_position_embeddings
        (item,) = generate_items(GenerateRequest.model_validate(payload), context_length=context)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((list(item.prompt), item.sampling, future))
        if self._draining is None or self._draining.done():
            self._draining = asyncio.create_task(self._drain())
        return [dataclasses.replace(r, prompt_index=prompt_index) for r in await future]

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let every request of the same gather() join the batch
        while self._queue:
            batch, self._queue = self._queue, []
            by_sampling: dict[SamplingParams, list] = {}
            for prompt, sampling, future in batch:
                by_sampling.setdefault(dataclasses.replace(sampling, seed=None), []).append(
                    (prompt, sampling, future)
                )
            for requests in by_sampling.values():
                sampling = requests[0][1]
                try:
                    rollouts = await asyncio.to_thread(
                        self.engine.generate,
                        [r[0] for r in requests],
                        sampling,
                        [r[1].seed for r in requests],
                    )
                except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
                    for _, _, future in requests:
                        future.done() or future.set_exception(exc)
                    continue
                for index, (_, _, future) in enumerate(requests):
                    mine = [r for r in rollouts if r.prompt_index == index]
                    future.done() or future.set_result(mine)

    def load_weights_now(self, named_tensors: dict[str, Tensor]) -> None:
        """Copy some of the model's tensors in place, by state-dict name (a partial load_state_dict)."""
        state = self.engine.model.state_dict(keep_vars=True)
        unknown = sorted(set(named_tensors) - set(state))
        if unknown:
            raise KeyError(f"the engine's model has no tensors named {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                state[name].copy_(tensor)

    async def release_memory_occupation(self, tags=None) -> None:
        """The KV cache lives only inside generate(); hand the CUDA allocator's free blocks back."""
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()

    async def resume_memory_occupation(self, tags=None) -> None:
        """Nothing was released that generate() does not rebuild."""

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        """Nothing to stop (the engine owns no thread, process or server)."""
