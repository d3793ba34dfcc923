"""The rollout records: what every generator (built-in, hf, SGLang) is asked and gives back.

An engine turns prompt token ids into `Rollout`s: the response token ids, the logprob of each sampled
token, a loss mask and why generation ended. `n` samples of one prompt come out next to each other
(prompt 0's n samples, then prompt 1's, ...) and carry `prompt_index`, which the trainer turns into
GRPO group ids.

Logprobs convention (every engine must follow it, the trainer's recomputation matches it): the logprob
of a sampled token is log_softmax(logits / temperature) at that token, i.e. under the temperature-scaled
model distribution, *before* top-k / top-p truncation. That is the distribution PPO's ratio is taken
against, and the one `Policy.compute_logprobs(..., temperature=...)` recomputes. With temperature 0
(greedy) the logprobs are those of the untempered model (temperature 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k -1 means no top-k; stop strings end a response
    right after the token that completes them (kept in the response, like the stop token ids)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past the engine's eos ids (stop_token_ids still stop)

    def __post_init__(self) -> None:
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def derived_seed(seed: int, *indices: int) -> int:
    """A distinct, reproducible 63-bit seed for each tuple of indices under one seed (the loop's per step
    and round, the manager's per prompt, the HTTP replica's per sample), so a sample gets the same seed
    wherever the replicas run and after a resume. SeedSequence takes non-negative entropy only."""
    entropy = [seed & (2**63 - 1), *indices]
    mixed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
    return int(mixed >> np.uint64(1))


# A rollout's number fields and their dtypes (int64 and float64 hold every engine's and JSON's values).
NUMBER_FIELDS = (
    ("prompt_ids", np.int64),
    ("response_ids", np.int64),
    ("logprobs", np.float64),
    ("loss_mask", np.int8),
)


@dataclass(eq=False)
class Rollout:
    """One generated response (a prompt sampled n times gives n Rollouts). Its number fields are numpy
    arrays (lists given are converted): a Ray rank's rollouts reach the driver as views into one
    message's columns, and the batch is made from them whole. As Python lists, 2,048 rollouts of 256
    tokens were ~1.8M objects that the driver built and read back (70 and 39 ms on a 2-core CPU: serial
    work that grows with the GPU count)."""

    prompt_ids: np.ndarray  # int64
    response_ids: np.ndarray  # int64
    logprobs: np.ndarray  # float64, per response token, see the module docstring
    loss_mask: np.ndarray  # int8, 1 per response token trained on (0 on tool output in multi-turn rollouts)
    finish_reason: FinishReason
    prompt_index: int  # index of the prompt in the list given to generate()

    def __post_init__(self) -> None:
        for name, dtype in NUMBER_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, np.ndarray) and value.dtype == dtype and value.ndim == 1):
                setattr(self, name, np.asarray(value, dtype=dtype).reshape(-1))

    def __eq__(self, other: object) -> bool:
        """Field by field, the arrays by their values."""
        if not isinstance(other, Rollout):
            return NotImplemented
        same = all(getattr(self, name) == getattr(other, name) for name in ("finish_reason", "prompt_index"))
        return same and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name, _ in NUMBER_FIELDS
        )


def pack_rollouts(rollouts: list[Rollout]) -> dict:
    """Rollouts as one array per number field (and its rows' lengths): what a Ray rank sends the driver,
    copied whole by pickle (protocol 5) rather than number by number."""
    packed: dict = {
        "finish_reason": [r.finish_reason for r in rollouts],
        "prompt_index": [r.prompt_index for r in rollouts],
    }
    for name, dtype in NUMBER_FIELDS:
        rows = [getattr(r, name) for r in rollouts]
        packed[name] = (
            concatenated(rows, dtype),
            np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)),
        )
    return packed


def concatenated(rows: list[np.ndarray], dtype) -> np.ndarray:
    """The rows' values end to end, as `dtype`."""
    if not rows:
        return np.empty(0, dtype=dtype)
    return np.concatenate(rows, dtype=dtype, casting="same_kind")


def unpack_rollouts(packed: dict) -> list[Rollout]:
    """pack_rollouts' inverse: each rollout's fields are views into the message's columns."""
    columns = {}
    for name, _ in NUMBER_FIELDS:
        flat, lengths = packed[name]
        columns[name] = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    columns["finish_reason"], columns["prompt_index"] = packed["finish_reason"], packed["prompt_index"]
    return [Rollout(**dict(zip(columns, row))) for row in zip(*columns.values())]
