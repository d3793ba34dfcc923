"""A neural reward model: AutoModelForSequenceClassification scoring (prompt, response) pairs, batched.

Loaded only when the server is started with `--reward-model PATH_OR_ID` (torch and transformers are
imported here and nowhere else in the reward-server). The text is the tokenizer's chat template over
[user: prompt, assistant: response] when it has one (how decoder reward models such as Skywork or
InternLM2 reward models are trained), else the tokenizer's (prompt, response) pair encoding (BERT-style).

Score: the single logit (num_labels == 1), or the probability of the last class (num_labels == 2).
Batches are padded on the right, so each sequence keeps the positions it has alone and a batched
score equals the one-at-a-time score; long inputs are cut on the left, keeping the response's end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger("services.reward_server.model")


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


class RewardModel:
    """One loaded reward model; `score` is thread-safe (one forward pass at a time)."""

    def __init__(
        self,
        path: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 16,
        max_length: int = 4096,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = pick_device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=pick_dtype(dtype, self.device), trust_remote_code=trust_remote_code
        )
        self.model.to(self.device).eval()
        if self.model.config.pad_token_id is None:
            # Decoder classifiers pool the last non-pad token; they need to know which id pads.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.num_labels = self.model.config.num_labels
        if self.num_labels not in (1, 2):
            raise ValueError(f"{path}: a reward model needs 1 or 2 labels, it has {self.num_labels}")
        self.uses_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self._lock = threading.Lock()
        log.info(
            "reward model loaded", extra={"path": path, "device": self.device, "labels": self.num_labels}
        )

    def _encode(self, prompts: Sequence[str], responses: Sequence[str]):
        if self.uses_chat_template:
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
                )
                for p, r in zip(prompts, responses)
            ]
            return self.tokenizer(
                texts,
                add_special_tokens=False,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
        return self.tokenizer(
            list(prompts),
            list(responses),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )

    def _forward(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        import torch

        batch = self._encode(prompts, responses).to(self.device)
        with torch.inference_mode():
            logits = self.model(**batch).logits.float()
        scores = logits[:, 0] if self.num_labels == 1 else torch.softmax(logits, dim=-1)[:, 1]
        return scores.cpu().tolist()

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per pair, in order. Sorted by length inside so each micro-batch pads little."""
        order = sorted(range(len(responses)), key=lambda i: len(prompts[i]) + len(responses[i]))
        scores = [0.0] * len(responses)
        with self._lock:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                values = self._forward([prompts[i] for i in chunk], [responses[i] for i in chunk])
                for i, value in zip(chunk, values):
                    scores[i] = value
        return scores
