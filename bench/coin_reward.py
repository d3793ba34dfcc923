"""The benchmarks' reward on random-weight models: a fair coin per response, read from its text's hash.

A random model never answers a GSM8K question, so the real reward scores every response 0, every GRPO
advantage is 0 and, without a KL term, the policy gradient is exactly zero. The backward matmuls then
multiply zeros, which a power-limited GPU runs faster than real gradients (on an H200 the same update
took 1.25 s on zeros against 1.36 s with a KL term's tiny but non-zero gradient: the same kernels, 10-20%
slower on real data). A coin per response gives each group mixed scores, so the update works on real
advantages as in training; both sides of a comparison score with it. verl's custom_reward_function form.
"""

from __future__ import annotations

import hashlib


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    return float(hashlib.sha256(solution_str.encode()).digest()[0] & 1)
