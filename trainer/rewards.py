"""Rewards for rollouts: the reward-server over HTTP, or the same scoring code in this process.

`reward_model.mode=server` sends batches to the reward-server (retries, replicas); `mode=local` runs
services.scoring's LocalScorer (the library the reward-server serves) here, or a verl-style
`custom_reward_function.path/name` when one is named. Either way the loop sees one call:
`await scorer.score(items, options) -> list[RewardResult]`. The default, `mode=auto`, is resolved by the
config: server when a reward-server URL is configured, else local (verl scores in-process).

In-process code rows run their tests in the code-executor verl's `reward_model.sandbox_fusion.url` names
(SandboxFusion's `.../run_code`, the code-executor's own route; its base URL is what the scorer takes).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from services.reward_server.schemas import RewardOptions, RewardResult
from services.scoring.shaping import overlong_penalty
from trainer.data import PromptRecord
from trainer.rollout.base import Rollout


class Scorer(Protocol):
    async def score(
        self, items: Sequence[dict], options: RewardOptions | None = None
    ) -> list[RewardResult]: ...


@dataclass(frozen=True)
class Scores:
    """One step's rewards, aligned with the rollouts."""

    scores: torch.Tensor  # [B] float32
    correct: torch.Tensor  # [B] float32, 1.0 where the answer was right
    errors: int  # items the scorer could not score (score 0)
    first_error: str | None = None  # the first of those errors, for the message that stops the run


class RewardErrors(RuntimeError):
    """Too many rewards of a round could not be computed: training on their zeros would teach nothing
    (a dataset name no scorer knows gave a whole run of 0.0 rewards). The message is one line."""


def check_reward_errors(
    errors: int, total: int, max_error_fraction: float, first_error: str | None = None
) -> float:
    """The share of rewards that are errors (metric reward/error_fraction); RewardErrors when some are and
    the share reaches `max_error_fraction` (reward_model.max_error_fraction: 1.0 stops only when all are).
    """
    if total <= 0:
        return 0.0
    fraction = errors / total
    if errors and fraction >= max_error_fraction:
        example = f"; first error: {first_error}" if first_error else ""
        raise RewardErrors(
            f"{errors} of {total} rewards could not be computed (reward/error_fraction {fraction:.3g} >= "
            f"reward_model.max_error_fraction {max_error_fraction:g}){example}"
        )
    return fraction


def decode_responses(tokenizer, ids: Sequence[np.ndarray]) -> list[str]:
    """tokenizer.batch_decode(ids, skip_special_tokens=True), in one call to a fast tokenizer's Rust
    backend where that is the same text (no clean-up of tokenization spaces): it decodes the batch on
    all cores, where batch_decode goes one sequence at a time (1,024 x 256 Qwen tokens: 92 against 150 ms
    on 2 cores), and takes the rollouts' arrays as they are. The driver decodes every rollout of a step,
    overlapped with the generation of the groups still running; a rank did not do it better: there the
    decode held up the engine's Python loop (BENCHMARKS.md, "rollouts as arrays", 2026-12-02)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.batch_decode([np.asarray(row).tolist() for row in ids], skip_special_tokens=True)
    return backend.decode_batch(ids, skip_special_tokens=True)


def reward_items(prompts: Sequence[PromptRecord], rollouts: Sequence[Rollout], tokenizer) -> list[dict]:
    """Reward-server items: the decoded response plus the prompt's reward fields."""
    texts = decode_responses(tokenizer, [r.response_ids for r in rollouts])
    items = []
    for rollout, text in zip(rollouts, texts, strict=True):
        prompt = prompts[rollout.prompt_index]
        extra = {**(prompt.extra_info or {}), "response_length": len(rollout.response_ids)}
        items.append(
            {
                "data_source": prompt.data_source,
                "response": text,
                "ground_truth": prompt.ground_truth,
                "extra_info": extra,
                "prompt": prompt.raw_prompt[-1]["content"] if prompt.raw_prompt else None,
            }
        )
    return items


def reward_options(reward_model, max_response_length: int) -> RewardOptions:
    """RewardOptions from the config's reward_model section (trainer.config.RewardModelConfig)."""
    overlong = reward_model.overlong_buffer
    shaping = {}
    if overlong.enable:
        shaping = {
            "overlong_enable": True,
            "overlong_max_len": max_response_length,
            "overlong_buffer_len": min(overlong.len, max_response_length),
            "overlong_penalty_factor": overlong.penalty_factor,
        }
    return RewardOptions(
        gsm8k_method=reward_model.gsm8k_method, format_score=reward_model.format_score, **shaping
    )


def scores_of(results: Sequence[RewardResult]) -> Scores:
    errors = [r.error for r in results if r.error is not None]
    return Scores(
        scores=torch.tensor([r.score for r in results], dtype=torch.float32),
        correct=torch.tensor([1.0 if r.correct else 0.0 for r in results], dtype=torch.float32),
        errors=len(errors),
        first_error=errors[0] if errors else None,
    )


class CustomFunctionScorer:
    """verl's custom_reward_function: `fn(data_source, solution_str, ground_truth, extra_info) -> float |
    dict`. DAPO's overlong penalty (reward_model.overlong_buffer) is added to what it returns, as verl's
    DAPO reward manager does whatever function scores; the built-in scorers' own knobs (gsm8k_method,
    format_score) do not reach it.
    """

    def __init__(self, path: str, name: str) -> None:
        spec = importlib.util.spec_from_file_location("custom_reward_module", path)
        if spec is None or spec.loader is None:
            raise FileNotFoundError(f"custom_reward_function.path {path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, name):
            raise AttributeError(f"custom_reward_function: {path} has no function {name!r}")
        self.fn: Callable[..., Any] = getattr(module, name)

    async def score(self, items: Sequence[dict], options: RewardOptions | None = None) -> list[RewardResult]:
        return await asyncio.to_thread(lambda: [self._one(item, options) for item in items])

    def _one(self, item: dict, options: RewardOptions | None) -> RewardResult:
        value = self.fn(item["data_source"], item["response"], item["ground_truth"], item.get("extra_info"))
        if inspect.isawaitable(value):
            raise TypeError("custom_reward_function must be synchronous")
        score = float(value["score"] if isinstance(value, dict) else value)
        correct = bool(value.get("acc", score > 0)) if isinstance(value, dict) else score > 0
        if options is not None and options.overlong_enable:
            score += overlong_penalty(
                item["extra_info"]["response_length"],
                options.overlong_max_len,
                options.overlong_buffer_len,
                options.overlong_penalty_factor,
            )
        return RewardResult(score=score, correct=correct)

    def close(self) -> None:
        pass


def code_executor_base_url(sandbox_fusion_url: str | None) -> str | None:
    """verl's sandbox_fusion.url (`http://host:8003/run_code`, or several comma-separated) as the
    code-executor base URL(s) LocalScorer takes; None (or empty) stays None: code rows then fail."""
    if not sandbox_fusion_url:
        return None
    urls = [url.strip().rstrip("/") for url in sandbox_fusion_url.split(",") if url.strip()]
    return ",".join(url.removesuffix("/run_code") for url in urls) or None


async def open_scorer(reward_model, services, custom_reward_function):
    """The scorer the config names (its reward_model, services and custom_reward_function sections, and
    reward_model.sandbox_fusion.url for code rows scored in-process); the server one has answered
    /health. Close with `close_scorer`. The server one keeps retrying a reward-server that stopped
    answering for services.retry_deadline_s from its first failure."""
    mode, custom_path = reward_model.mode, custom_reward_function.path
    if mode == "local":
        if custom_path:
            return CustomFunctionScorer(custom_path, custom_reward_function.name or "compute_score")
        from services.scoring import LocalScorer

        return LocalScorer(
            code_executor_url=code_executor_base_url(reward_model.sandbox_fusion.url),
            code_executor_token=services.auth_token,
        )
    from services.reward_server.client import RewardClient

    client = RewardClient(
        services.reward_url,
        timeout_s=services.timeout_s,
        retries=services.retries,
        token=services.auth_token,
        deadline_s=services.retry_deadline_s,
    )
    try:
        await client.wait_healthy(services.health_timeout_s)
    except BaseException:
        await client.aclose()
        raise
    return client


async def close_scorer(scorer) -> None:
    if hasattr(scorer, "aclose"):
        await scorer.aclose()
    else:
        scorer.close()
