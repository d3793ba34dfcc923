"""The Triton kernels of the GPU fast path against the plain torch path they replace.

On a CPU machine with Triton installed the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
in a subprocess, because the variable must be set before Triton compiles anything); CI's CPU-only torch
has no Triton, so there this file skips and the GPU run (test_rollout_gpu.py) checks the compiled kernels
with the same `check_kernels`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers import ROOT


def check_kernels(device: str, dtype: torch.dtype, atol: float) -> None:
    """Each kernel vs the torch ops it replaces, on random inputs of engine-like shapes."""
    from trainer.rollout.builtin import kernels
    from trainer.rollout.builtin.model import rms_norm, rotate_half, torch_decode_attention
    from trainer.rollout.builtin.sampler import token_seeds, torch_sample

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

    batch, hidden, heads, kv_heads, dim, slots, context = 5, 96, 6, 2, 16, 7, 40
    # add + RMSNorm
    x, residual, weight = rand(batch, hidden), rand(batch, hidden), rand(hidden)
    expected_residual = residual + x
    expected = rms_norm(expected_residual, weight, 1e-6)
    got = kernels.add_rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(residual, expected_residual, atol=atol, rtol=0)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    torch.testing.assert_close(
        kernels.add_rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), atol=atol, rtol=0
    )
    # RoPE + cache write
    qkv = rand(batch, (heads + 2 * kv_heads) * dim)
    angles = torch.arange(context, dtype=torch.float32)[:, None] * torch.rand(dim // 2, generator=gen)[None]
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    k_cache = torch.zeros(slots, kv_heads, context, dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slot_ids = torch.tensor([3, 0, 6, 1, 4], device=device)
    lengths = torch.tensor([1, 9, 40, 17, 33], device=device)
    q = kernels.rope_and_cache(qkv, cos, sin, slot_ids, lengths, k_cache, v_cache, heads, kv_heads)
    parts = qkv.unflatten(-1, (heads + 2 * kv_heads, dim))
    c, s = cos[lengths - 1][:, None], sin[lengths - 1][:, None]
    torch.testing.assert_close(q, parts[:, :heads] * c + rotate_half(parts[:, :heads]) * s, atol=atol, rtol=0)
    keys = parts[:, heads : heads + kv_heads]
    torch.testing.assert_close(
        k_cache[slot_ids, :, lengths - 1], keys * c + rotate_half(keys) * s, atol=atol, rtol=0
    )
    torch.testing.assert_close(
        v_cache[slot_ids, :, lengths - 1], parts[:, heads + kv_heads :], atol=0, rtol=0
    )
    # SiLU and multiply
    gate_up = rand(batch, 2 * 1500)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(
        kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=atol, rtol=atol
    )
    # decode attention reads only each sequence's filled cache
    long_context = 200  # several 64-position blocks: splits share a sequence and get merged
    k_cache, v_cache = rand(slots, kv_heads, long_context, dim), rand(slots, kv_heads, long_context, dim)
    lengths = torch.tensor([1, 70, 200, 129, 64], device=device)
    q = rand(batch, heads, dim)
    expected = torch_decode_attention(q, k_cache, v_cache, slot_ids, lengths)
    for splits in (1, 3, 8):  # 8 splits of these lengths leave some empty
        got = kernels.decode_attention(q, k_cache, v_cache, slot_ids, lengths, splits=splits)
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    k_cache[slot_ids[0], :, 1:] = float("nan")  # past a sequence's length: never read
    torch.testing.assert_close(
        kernels.decode_attention(q, k_cache, v_cache, slot_ids, lengths, splits=3)[0],
        expected[0],
        atol=atol,
        rtol=0,
    )
    # fused sampling: greedy rows are the argmax with the untempered logprob; sampled rows draw from
    # softmax(logits / T) and report that logprob; the floor (top-k / top-p) is respected
    rows, vocab = 2000, 50
    logits = (torch.randn(1, vocab, generator=gen) * 2).repeat(rows, 1).to(device, dtype)
    temps = torch.full((rows,), 0.7, device=device)
    temps[:10] = 0
    seeds = torch.from_numpy(token_seeds(np.arange(rows), np.zeros(rows, dtype=np.int64))).to(device)
    last = torch.zeros(rows + 1, dtype=torch.int64, device=device)
    row_slots = torch.arange(rows, device=device)
    tokens, logprobs = kernels.fused_sample(logits, temps, seeds, None, row_slots, last)
    assert torch.equal(last[:rows], tokens)
    reference_tokens, _ = torch_sample(logits[:10], temps[:10], seeds[:10], None)
    assert torch.equal(tokens[:10], reference_tokens)
    scaled = logits.float() / torch.where(temps == 0, 1.0, temps)[:, None]
    torch.testing.assert_close(
        logprobs, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1), atol=1e-4, rtol=0
    )
    observed = torch.bincount(tokens[10:].cpu(), minlength=vocab).float() / (rows - 10)
    assert (observed - torch.softmax(scaled[-1].cpu(), -1)).abs().max() < 0.035
    floors = torch.full((rows,), float(logits[0].float().topk(3).values[-1]), device=device)
    tokens, _ = kernels.fused_sample(logits, temps, seeds, floors, row_slots, last)
    assert set(tokens.tolist()) <= set(logits[0].float().topk(3).indices.tolist())
    # the vocabulary in splits (a first-pass program each, the draw's split found from their masses):
    # the same tokens and logprobs as one program a row, with and without a floor
    rows, vocab = 48, 700
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(device, dtype)
    temps, row_slots = torch.full((rows,), 0.8, device=device), torch.arange(rows, device=device)
    temps[:4] = 0
    seeds = torch.from_numpy(token_seeds(np.arange(rows), np.ones(rows, dtype=np.int64))).to(device)
    floors = logits.float().topk(40, dim=-1).values[:, -1].contiguous()
    saved = dict(kernels.SAMPLE_CONFIG)
    drawn = {}
    try:
        for splits in (1, 5):
            kernels.SAMPLE_CONFIG.update(BLOCK=64, SPLITS=splits)
            for floor in (None, floors):
                last = torch.zeros(rows + 1, dtype=torch.int64, device=device)
                drawn[splits, floor is None] = kernels.fused_sample(
                    logits, temps, seeds, floor, row_slots, last
                )
    finally:
        kernels.SAMPLE_CONFIG.update(saved)
    for no_floor in (True, False):
        (one, one_lp), (split, split_lp) = drawn[1, no_floor], drawn[5, no_floor]
        assert torch.equal(split, one)
        torch.testing.assert_close(split_lp, one_lp, atol=1e-5, rtol=0)
    assert bool((logits.float().gather(-1, drawn[5, False][0][:, None])[:, 0] >= floors).all())


def check_fused_engine(device: str) -> None:
    """The whole fused engine (Triton attention, fused layers, fused sampling; graphs on CUDA) in fp32
    reproduces transformers' greedy decoding, alone and under continuous batching."""
    from tests.trainer.test_rollout_engine import encode, engine_for, hf_greedy, varied_model
    from trainer.rollout.base import SamplingParams

    model, tok = varied_model("qwen2", seed=1)
    engine = engine_for(model.to(device), tok, max_running=3, max_prefill_tokens=40)
    assert engine.fused and engine.runner.fused
    prompts = encode(tok)
    lengths = [20, 6, 14, 9, 3]
    outputs = {}
    for index, (prompt, length) in enumerate(zip(prompts, lengths)):
        sampling = SamplingParams(temperature=0, max_new_tokens=length, ignore_eos=True)
        engine.add(prompt, sampling, lambda o, index=index: outputs.update({index: o}))
    while engine.has_work:
        engine.step()
    for index, (prompt, length) in enumerate(zip(prompts, lengths)):
        assert outputs[index][0].token_ids == hf_greedy(model, prompt, length), index


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_match_the_torch_path_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    script = (
        "import torch\n"
        "from tests.trainer.test_rollout_kernels import check_kernels, check_fused_engine\n"
        "check_kernels('cpu', torch.float32, atol=1e-5)\n"
        "check_fused_engine('cpu')\n"
        "print('kernels ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-4000:]
