"""Rollout throughput: transformers `generate` against the built-in engine, same model, same run.

    python bench/rollout.py [--batches 64,256,512] [--prompts 256] [--prompt-len 128] [--new-tokens 256]
                            [--json out.json] [--small]

Qwen2.5-0.5B-shaped random bf16 weights (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied
embeddings), prompts of random token ids, temperature 1 without top-k / top-p, EOS ignored: every sequence
generates exactly --new-tokens tokens. "Batch B" is B sequences decoding together:
- transformers `generate` runs one static batch of B sequences (its throughput is the same for every
  batch of B, so one batch is timed); B > prompts uses num_return_sequences = B / prompts;
- the engine gets all prompts (n = B / prompts samples each when B > prompts) with B KV slots and
  continuous batching, prefill included in the time.
Roofline: the bytes a decode step must move (every weight once, plus the KV cache read so far) and the
FLOPs (2 x matmul parameters per token, attention, prefill), against the GPU's datasheet peaks and against
a copy and a matmul measured in the same run. --small: a tiny model on CPU (smoke run, no roofline).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DATASHEET = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}  # bytes/s, dense bf16 FLOP/s (SXM)


def build_model(small: bool, device: str):
    from transformers import Qwen2ForCausalLM

    from testing.tiny import qwen25_05b_config, tiny_qwen2_config

    config = tiny_qwen2_config(vocab=512, hidden=64, layers=2) if small else qwen25_05b_config()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.float32 if small else torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: fixed-length responses
    model.generation_config.pad_token_id = 0
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_hf(model, prompts: torch.Tensor, new_tokens: int, n: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        num_return_sequences=n,
    )
    sync(device)
    return time.perf_counter() - start


def time_engine(engine, prompts: list[list[int]], new_tokens: int, n: int, device: str) -> tuple[float, int]:
    from trainer.rollout.base import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n, seed=0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    sync(device)
    return time.perf_counter() - start, sum(len(s.token_ids) for group in outputs for s in group)


def work(shape, weight_bytes: int, sequences: int, concurrency: int, prompts: int, p: int, new: int):
    """(bytes, flops) the run must move / compute at the least (decode steps plus prefill)."""
    waves = math.ceil(sequences / concurrency)
    kv_bytes = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2  # per cached position, bf16
    positions_read = sequences * (new * p + new * (new + 1) // 2)  # each new token reads its whole prefix
    per_token = 2 * (
        shape.layers
        * shape.hidden
        * (
            (shape.heads + 2 * shape.kv_heads) * shape.head_dim
            + shape.heads * shape.head_dim
            + 3 * shape.intermediate
        )
    )
    attention = 4 * shape.layers * shape.heads * shape.head_dim
    decode_flops = sequences * new * (per_token + 2 * shape.hidden * shape.vocab) + attention * positions_read
    prefill_flops = prompts * p * per_token + attention * prompts * p * (p + 1) // 2
    return waves * new * weight_bytes + positions_read * kv_bytes, decode_flops + prefill_flops


def measured_peaks(device: str) -> tuple[float, float]:
    """A device-to-device copy (bytes read + written per second) and an 8192^3 bf16 matmul (FLOP/s)."""
    buffer = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(buffer)
    target.copy_(buffer)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(buffer)
    sync(device)
    bandwidth = 10 * 2 * buffer.numel() * 2 / (time.perf_counter() - start)
    del buffer, target
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return bandwidth, 10 * 2 * 8192**3 / (time.perf_counter() - start)


def tune_kernels(batch: int = 256, length: int = 256, context: int = 384) -> dict:
    """Time the decode-attention and sampling kernels under a few launch configurations."""
    import triton.testing

    from trainer.rollout.builtin import kernels

    q = torch.randn(batch, 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch + 1, 2, context, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device="cuda")
    lengths = torch.full((batch,), length, device="cuda")
    timings = {}
    default = dict(kernels.ATTENTION_CONFIG)
    configs = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 2, 2), (64, 8, 2), (64, 4, 3), (128, 8, 3)]
    for block_n, warps, stages in configs:
        kernels.ATTENTION_CONFIG.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        ms = triton.testing.do_bench(lambda: kernels.decode_attention(q, k, v, slots, lengths))
        timings[f"attention BLOCK_N={block_n} warps={warps} stages={stages}"] = ms * 1000
    kernels.ATTENTION_CONFIG.update(default)
    logits = torch.randn(batch, 151936, device="cuda", dtype=torch.bfloat16)
    temps = torch.ones(batch, device="cuda")
    seeds = torch.arange(batch, device="cuda")
    last = torch.zeros(batch + 1, dtype=torch.int64, device="cuda")
    default = dict(kernels.SAMPLE_CONFIG)
    for block, warps, splits in [(2048, 8, 1), (2048, 8, 16), (2048, 8, 32), (1024, 4, 32), (4096, 8, 16)]:
        kernels.SAMPLE_CONFIG.update(BLOCK=block, num_warps=warps, SPLITS=splits)
        ms = triton.testing.do_bench(lambda: kernels.fused_sample(logits, temps, seeds, None, slots, last))
        timings[f"sample BLOCK={block} warps={warps} SPLITS={splits}"] = ms * 1000
    kernels.SAMPLE_CONFIG.update(default)
    for name, us in timings.items():
        print(f"  {name}: {us:.1f} us", flush=True)
    return timings


def profile_engine(engine, prompts: list[list[int]], n: int) -> str:
    """The GPU kernels of a short generation, by total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_engine(engine, prompts, 32, n, "cuda")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table, flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--small", action="store_true", help="a tiny model on CPU (smoke run)")
    parser.add_argument(
        "--skip-hf", action="store_true", help="engine only (no baseline: not for the record)"
    )
    parser.add_argument("--tune", action="store_true", help="time kernel launch configurations first")
    parser.add_argument("--profile", action="store_true", help="profile the engine at the first batch size")
    args = parser.parse_args()

    from trainer.rollout.builtin import EngineConfig, load_engine

    device = "cpu" if args.small else "cuda"
    model = build_model(args.small, device)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=generator)
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    result = {
        "device": gpu,
        "torch": torch.__version__,
        "args": vars(args) | {"json": str(args.json)},
        "rows": [],
    }
    if device == "cuda":
        bandwidth, flops = measured_peaks(device)
        result["measured"] = {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops": flops}
        datasheet = next((v for k, v in DATASHEET.items() if k in gpu), None)
        result["datasheet"] = {"bytes_per_s": datasheet[0], "flops": datasheet[1]} if datasheet else None
        print(
            f"{gpu}: measured copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s",
            flush=True,
        )
    if args.tune and device == "cuda":
        result["tune_us"] = tune_kernels()
    if not args.skip_hf:  # warm-up: kernels, allocator
        time_hf(model, prompt_ids[:8].to(device), 8, 1, device)

    for batch in [int(b) for b in args.batches.split(",")]:
        n = max(1, batch // args.prompts)
        row = {"batch": batch, "n": n}
        if not args.skip_hf:
            hf_prompts = prompt_ids[: min(batch, args.prompts)].to(device)
            seconds = time_hf(model, hf_prompts, args.new_tokens, n, device)
            row["hf_tokens_per_s"] = hf_prompts.shape[0] * n * args.new_tokens / seconds
            print(f"batch {batch}: transformers generate {row['hf_tokens_per_s']:,.0f} tokens/s", flush=True)
        config = EngineConfig(
            max_running=batch, context_length=args.prompt_len + args.new_tokens, max_prefill_tokens=32768
        )
        engine = load_engine(model, dtype=model.dtype, device=device, config=config, eos_token_ids=())
        start = time.perf_counter()
        engine.warmup()
        time_engine(engine, prompt_ids[: min(batch, args.prompts)].tolist(), 8, n, device)  # compile, warm
        row["engine_warmup_s"] = time.perf_counter() - start
        seconds, tokens = time_engine(engine, prompt_ids.tolist(), args.new_tokens, n, device)
        row |= {"engine_tokens_per_s": tokens / seconds, "engine_seconds": seconds, "engine_tokens": tokens}
        if "hf_tokens_per_s" in row:
            row["speedup"] = row["engine_tokens_per_s"] / row["hf_tokens_per_s"]
        if device == "cuda":
            needed_bytes, needed_flops = work(
                engine.model.shape,
                engine.model.nbytes,
                tokens // args.new_tokens,
                batch,
                args.prompts,
                args.prompt_len,
                args.new_tokens,
            )
            row |= {"bytes_per_s": needed_bytes / seconds, "flops_per_s": needed_flops / seconds}
            row["of_measured_copy"] = row["bytes_per_s"] / result["measured"]["copy_bytes_per_s"]
            row["of_measured_matmul"] = row["flops_per_s"] / result["measured"]["bf16_matmul_flops"]
            if result["datasheet"]:
                row["of_datasheet_bandwidth"] = row["bytes_per_s"] / result["datasheet"]["bytes_per_s"]
                row["of_datasheet_flops"] = row["flops_per_s"] / result["datasheet"]["flops"]
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        if args.profile and device == "cuda" and "profile" not in result:
            result["profile"] = profile_engine(engine, prompt_ids.tolist(), n)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
