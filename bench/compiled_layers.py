"""What compiling the decoder layers with every size symbolic costs (GPU).

    python bench/compiled_layers.py            # on a CUDA machine, ~2 min

1. silu(gate) * up on [43k tokens, 4864] bf16 (Qwen2.5-0.5B's MLP at a packed micro-batch of 128
   GSM8K responses): eager, compiled with every size symbolic, compiled static, and torch.add of the
   same bytes as the bandwidth reference; TB/s.
2. The Qwen2.5-0.5B backbone (random weights, bf16, packed ~43k tokens) forward and backward, its decoder
   layers compiled by `trainer.compiling.compile_model` ("tokens": only the token count symbolic) and as
   before 2026-11-29 ("all": torch.compile(dynamic=True)); ms per iteration (median of 6 after three
   warm-up shapes) and the largest kernels of one profiled iteration.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2ForCausalLM

from testing.tiny import qwen25_05b_config
from trainer import compiling
from trainer.packing import pack, use_packed_attention

DEVICE = torch.device("cuda")


def seconds(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def silu_mul(gate, up):
    return F.silu(gate) * up


def pointwise(tokens: int = 43_000, intermediate: int = 4864) -> None:
    gate = torch.randn(tokens, intermediate, device=DEVICE, dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    moved = 3 * gate.numel() * gate.element_size()
    cases = {
        "eager": silu_mul,
        "compiled, every size symbolic": torch.compile(silu_mul, dynamic=True),
        "compiled, static": torch.compile(silu_mul, dynamic=False),
        "torch.add, same bytes": torch.add,
    }
    for name, fn in cases.items():
        s = seconds(lambda fn=fn: fn(gate, up))
        print(f"silu(gate) * up  {name:32s} {s * 1e3:7.3f} ms  {moved / s / 1e12:5.2f} TB/s")


def every_size_symbolic(layer_class, backend):  # trainer/compiling.py before 2026-11-29
    return torch.compile(layer_class.forward, dynamic=True, backend=backend)


def micro_batch(seed: int, rows: int = 128) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(250, 420, (rows,), generator=gen)
    ids = torch.randint(0, 150_000, (rows, int(lengths.max())), generator=gen).to(DEVICE)
    return pack(ids, torch.zeros(rows, dtype=torch.long), lengths).model_kwargs() | {"use_cache": False}


def backbone(mode: str) -> None:
    torch._dynamo.reset()
    compiling._COMPILED.clear()
    original = compiling._compiled_forward
    if mode == "all":
        compiling._compiled_forward = every_size_symbolic
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen25_05b_config()).to(DEVICE, torch.bfloat16)
    use_packed_attention(model)
    try:
        bf16 = torch.bfloat16
        assert compiling.compile_model(model, device=DEVICE, dtype=bf16, autocast_dtype=bf16)
    finally:
        compiling._compiled_forward = original
    batches = [micro_batch(seed) for seed in range(6)]

    def step(kwargs):
        with torch.autocast("cuda", torch.bfloat16):
            hidden = model.model(**kwargs).last_hidden_state
        hidden.float().square().mean().backward()

    for kwargs in batches[:3]:
        step(kwargs)
    times = []
    for kwargs in batches[3:] * 2:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    low, median, high = (times[i] * 1e3 for i in (0, 3, -1))
    print(f"== {mode}: forward + backward {median:.1f} ms (median; {low:.1f}-{high:.1f})")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batches[4])
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    print(f"   kernels {sum(e.self_device_time_total for e in kernels) / 1e3:.1f} ms, the largest:")
    for e in kernels[:12]:
        print(f"   {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}  {e.key[:100]}")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    pointwise()
    for mode in ("all", "tokens"):
        backbone(mode)
