"""Where the actor update's MFU goes: one packed micro-batch of a Qwen2.5-0.5B-shaped model on one GPU.

    python bench/actor_mfu.py [--seqs 32] [--response-len 256] [--json runs/actor_mfu.json]
    python bench/actor_mfu.py --smoke     # CPU, tiny model, tiny batch: proves the plumbing only
    python bench/actor_mfu.py --only f32-compiled --profile runs/actor_mfu_profile.txt

--profile: after timing, three more steps of each variant run under torch.profiler; the file gets
the GPU time per step by kind of kernel (matmul, flash attention, Triton-fused, other) and the 25
kernels that took longest, so "where the rest goes" is read, not guessed.

Rows (median ms of several reps after warm-up; CUDA events on GPU, perf_counter on CPU):
- gemm_ceiling: only the matmuls of one forward + backward at this token count, bf16 `@` on random
  tensors (per layer q/k/v/o, gate/up/down; the LM head over the response tokens, in the trainer's
  2048-token chunks); backward = grad input + grad weight per forward matmul. The best the model path
  could do with perfect everything else.
- model[...]: the trainer's own path, built as trainer/build.py builds a one-process policy (load_policy,
  use_packed_attention, compile_model, the fused LogprobHead), forward + response_logprobs + a
  mean-logprob loss + backward: parameters fp32 (the trainer's) or bf16, under bf16 autocast, decoder
  layers eager or compiled, and once with gradient checkpointing (grpo_gsm8k.yaml turns it on).
- adamw_step[...]: the project's AdamW (fused on CUDA) step over all parameters; paid once per mini-batch.

TFLOP/s and MFU use the trainer's counting (trainer.tracking.training_flops, 6 N per token + attention,
the LM head counted on every token), so the MFU column is what perf/mfu/actor would say if the update
took only this row's time. For gemm_ceiling the note gives the FLOP/s of the matmuls actually run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testing.tiny import make_tiny_model, qwen25_05b_config, tiny_qwen2_config
from trainer.batch import TrainBatch
from trainer.compiling import compile_model
from trainer.parallel.distributed import DataParallel
from trainer.parallel.fsdp import FSDPSettings, full_tensor, shard_model
from trainer.model import autocast, load_policy
from trainer.packing import use_packed_attention
from trainer.rollout.base import Rollout
from trainer.tracking import peak_flops_per_gpu, training_flops
from trainer.workers.common import OptimizerSettings, build_optimizer
from trainer.compiling import CompiledOrEager
from trainer.workers import logprobs
from trainer.workers.logprobs import DEFAULT_LOGITS_CHUNK_SIZE, LogprobHead, response_logprobs

# a constant LR: only the step's kernels matter here
ADAMW = OptimizerSettings(
    lr=1e-6, weight_decay=0.01, betas=(0.9, 0.999), grad_clip=1.0, warmup_steps=0, total_steps=10,
    schedule="constant", min_lr_ratio=0.0,
)  # fmt: skip


def median_ms(fn, device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):  # compilation, cuBLAS heuristics and the caching allocator settle here
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def make_batch(seqs: int, prompt_range: tuple[int, int], response_len: int, vocab: int, seed: int):
    """A micro-batch shaped like GSM8K GRPO: prompts of uniform length in prompt_range, full responses."""
    rng = random.Random(seed)
    rollouts = []
    for index in range(seqs):
        prompt = rng.randint(*prompt_range)
        rollouts.append(
            Rollout(
                prompt_ids=[rng.randrange(10, vocab) for _ in range(prompt)],
                response_ids=[rng.randrange(10, vocab) for _ in range(response_len)],
                logprobs=[0.0] * response_len,
                loss_mask=[1] * response_len,
                finish_reason="length",
                prompt_index=index,
            )
        )
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


def gemm_ceiling(config, tokens: int, response_tokens: int, device, timing) -> tuple[float, float]:
    """(ms, FLOPs actually run) of the model's matmuls alone, bf16, forward + backward."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q k v o: (out, in)
    shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]  # gate up down
    bf16 = {"device": device, "dtype": torch.bfloat16}
    # distinct weights per layer, so no layer finds the previous one's weights in L2
    layers = [[torch.randn(o, i, **bf16) for o, i in shapes] for _ in range(config.num_hidden_layers)]
    inputs = {i: torch.randn(tokens, i, **bf16) for i in (hidden, inter)}
    head = torch.randn(config.vocab_size, hidden, **bf16)
    head_in = torch.randn(response_tokens, hidden, **bf16)
    chunk = DEFAULT_LOGITS_CHUNK_SIZE

    def run() -> None:
        for weights in layers:
            for w in weights:
                x = inputs[w.shape[1]]
                grad_out = x @ w.T  # stands in for the output's gradient: same shape
                _ = grad_out @ w, grad_out.T @ x
        for s in range(0, response_tokens, chunk):
            h = head_in[s : s + chunk]
            grad_logits = h @ head.T
            _ = grad_logits @ head, grad_logits.T @ h

    flops = 3 * 2 * tokens * sum(o * i for o, i in shapes) * config.num_hidden_layers
    flops += 3 * 2 * response_tokens * config.vocab_size * hidden
    return median_ms(run, device, *timing), flops


KERNEL_KINDS = (  # substrings of CUDA kernel names -> what they are
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("flash attention", ("flash",)),
    ("triton (fused by torch.compile)", ("triton",)),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def profile_steps(step, steps: int = 3) -> str:
    """GPU time a step by kernel kind, and the top kernels, over `steps` profiled calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - began) * 1e3 / steps
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    launches = 0
    for event in kernels:
        by_kind[kernel_kind(event.key)] = by_kind.get(kernel_kind(event.key), 0.0) + event.device_time_total
        launches += event.count
    gpu_ms = sum(by_kind.values()) / 1e3 / steps
    lines = [
        f"wall {wall_ms:.1f} ms a step (under the profiler), GPU kernels {gpu_ms:.1f} ms, "
        f"{launches / steps:.0f} kernels a step"
    ]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<34} {us / 1e3 / steps:8.1f} ms")
    lines.append("top kernels (ms a step, calls a step):")
    for event in sorted(kernels, key=lambda e: -e.device_time_total)[:25]:
        per_step_ms = event.device_time_total / 1e3 / steps
        lines.append(f"  {per_step_ms:8.2f} {event.count // steps:6d}  {event.key[:100]}")
    return "\n".join(lines)


HEAD_CHUNK = [DEFAULT_LOGITS_CHUNK_SIZE]  # --head-chunk


def dtype_label(param_dtype) -> str:
    """A variant's parameter name in the table: "float32", "bfloat16", or an FSDP variant's own name."""
    return param_dtype if isinstance(param_dtype, str) else str(param_dtype).removeprefix("torch.")


def one_rank_process_group(device) -> None:
    """torch.distributed with one rank (FSDP2 needs a process group even then)."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def model_fwd_bwd(
    path, batch, *, device, param_dtype, compiled, checkpointing, timing, backend, profile=False,
    token_major=True,
):  # fmt: skip
    """(ms of forward + loss + backward, ms of one AdamW step, note) for the trainer's policy path.

    param_dtype "fsdp": as a Ray policy rank holds it (trainer/parallel/ranks.py): fp32 on the CPU,
    compiled for bf16 compute, FSDP2-sharded over a one-rank process group (bf16 gathers, fp32
    reduction), and no autocast."""
    sharded = param_dtype.startswith("fsdp") if isinstance(param_dtype, str) else False
    model = load_policy(
        str(path),
        device="cpu" if sharded else device,
        param_dtype=torch.float32 if sharded else param_dtype,
        gradient_checkpointing=checkpointing,
    )
    use_packed_attention(model, token_major=token_major)
    note = ""
    # fsdp-autocast: the rank's compute under bf16 autocast as one process runs it (fp32 norms, softmax)
    autocast_dtype = None if param_dtype in ("fsdp", "fsdp-keep") else torch.bfloat16
    if compiled:
        # trainer/build.py: compile_model(..., dtype=None, autocast_dtype=precision.autocast_dtype)
        compiled = compile_model(
            model,
            device=device,
            dtype=torch.bfloat16 if sharded else None,
            autocast_dtype=autocast_dtype,
            backend=backend,
        )
        note = "" if compiled else "compile probe failed: eager"
    if sharded:
        one_rank_process_group(device)
        # fsdp-keep: gathered parameters kept from forward to backward (reshard_after_forward=False)
        keep = param_dtype == "fsdp-keep"
        settings = FSDPSettings(param_dtype=torch.bfloat16, reshard_after_forward=not keep)
        shard_model(model, DataParallel(), settings, device)
    head = LogprobHead(chunk_size=HEAD_CHUNK[0], fused=True, compiled=compiled)
    mask = batch.response_mask

    def step() -> None:
        model.zero_grad(set_to_none=True)  # the first micro-batch of a mini-batch: grads are assigned
        with autocast(device, autocast_dtype):
            # as Policy.train_mini_batch: entropy for the metric, no entropy gradient (entropy_coeff 0)
            out = response_logprobs(model, batch, with_entropy=True, entropy_grad=False, head=head)
        loss = -(out.logprobs * mask).sum() / mask.sum()
        loss.backward()

    ms = median_ms(step, device, *timing)
    profiled = profile_steps(step) if profile and device.type == "cuda" else None
    optimizer, _ = build_optimizer(model, ADAMW)
    optimizer_ms = median_ms(optimizer.step, device, *timing)  # the grads of the last step() stay
    # the global grad norm as clip_and_step takes it (FSDP: over DTensors, then gathered)
    trainable = [p for p in model.parameters() if p.requires_grad]
    clip_ms = median_ms(lambda: full_tensor(torch.nn.utils.clip_grad_norm_(trainable, 1e9)), device, *timing)
    note = f"{note} grad-norm {clip_ms:.1f} ms".strip()
    if profiled:
        note = note + "\n" + profiled  # the caller splits the profile off at the first newline
    return ms, optimizer_ms, note


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt-min", type=int, default=70)
    parser.add_argument("--prompt-max", type=int, default=170)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated variants: ceiling, f32-eager, "
        "f32-compiled, f32-ckpt, bf16-eager, bf16-compiled (default: all)",
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="kernel breakdown of each variant, to this file"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch, 1+2 reps")
    # A/B knobs of the fused logprob head (trainer/workers/logprobs.py)
    parser.add_argument(
        "--attention",
        default="token-major",
        help="comma-separated: token-major (the trainer's packed attention forward), own (the module's "
        "own forward: head-major q/k/v around the attention call), for an A/B",
    )
    parser.add_argument("--head-chunk", type=int, default=DEFAULT_LOGITS_CHUNK_SIZE, help="tokens a chunk")
    parser.add_argument("--head-dynamic", choices=["auto", "true"], default="auto", help="compile dynamic=")
    parser.add_argument("--head-accumulate", choices=["addmm", "cast"], default="addmm")
    args = parser.parse_args()
    HEAD_CHUNK[0] = args.head_chunk
    dynamic = None if args.head_dynamic == "auto" else True
    logprobs._STATS = CompiledOrEager(logprobs.chunk_stats, dynamic=dynamic)
    logprobs._LOGITS_GRAD = CompiledOrEager(logprobs.chunk_logits_grad, dynamic=dynamic)
    logprobs._ADDMM_FP32[0] = args.head_accumulate == "addmm"

    if args.smoke:
        device, backend, timing = torch.device("cpu"), "eager", (1, 2)  # eager backend: no C++ compile
        config = tiny_qwen2_config(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2)
        seqs, prompt_range, response_len, tokenizer = 4, (6, 12), 16, "char"
    else:
        device, backend, timing = torch.device("cuda"), "inductor", (args.warmup, args.reps)
        config, tokenizer = qwen25_05b_config(), "qwen"
        seqs, prompt_range, response_len = args.seqs, (args.prompt_min, args.prompt_max), args.response_len
    torch.manual_seed(args.seed)
    batch = make_batch(seqs, prompt_range, response_len, config.vocab_size, args.seed).to(device)
    seq_lens = (batch.prompt_lengths + batch.response_lengths).tolist()
    tokens, response_tokens = sum(seq_lens), int(batch.response_lengths.sum())
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = peak_flops_per_gpu(device_name) if device.type == "cuda" else None
    path = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="actor_mfu_")) / "model", config=config, tokenizer=tokenizer
    )
    model_params = sum(p.numel() for p in load_policy(str(path)).parameters())  # as PolicyProfile.of counts
    flops = training_flops(
        num_params=model_params,
        seq_lens=seq_lens,
        num_layers=config.num_hidden_layers,
        attention_dim=config.hidden_size,
    )

    rows = []

    def record(variant: str, fn, counted: bool = True) -> None:
        """counted=False: not a forward + backward, so no TFLOP/s or MFU."""
        try:
            ms, note = fn()
        except Exception as exc:  # noqa: BLE001 - a failed variant is a row with its error, not an abort
            ms, note = None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
        if device.type == "cuda":  # the variant's model and optimizer are gone: give their memory back
            torch.cuda.empty_cache()
        tflops = flops / (ms * 1e-3) / 1e12 if ms and counted else None
        mfu = tflops * 1e12 / peak if tflops and peak else None
        rows.append(dict(variant=variant, ms=ms, tflops=tflops, mfu=mfu, note=note))
        print(f"  {variant}: {ms} ms {note}", file=sys.stderr, flush=True)

    def ceiling():
        ms, run_flops = gemm_ceiling(config, tokens, response_tokens, device, timing)
        return ms, f"matmuls run at {run_flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s"

    only = set(args.only.split(",")) if args.only else None
    if only is None or "ceiling" in only:
        record("gemm_ceiling", ceiling)
    profiles = []
    optimizer_ms = {}
    f32, bf16 = torch.float32, torch.bfloat16  # (parameter dtype, compiled layers, gradient checkpointing):
    variants = [
        (f32, False, False),
        (f32, True, False),
        (f32, False, True),
        (bf16, False, False),
        (bf16, True, False),
        ("fsdp", True, False),  # a Ray policy rank's model: FSDP2 over one rank, bf16 gathers
        ("fsdp-autocast", True, False),
        ("fsdp-keep", True, False),
    ]
    layouts = [mode == "token-major" for mode in args.attention.split(",")]
    for (param_dtype, compiled, checkpointing), token_major in itertools.product(variants, layouts):
        kind = "ckpt" if checkpointing else "compiled" if compiled else "eager"
        dtype_name = dtype_label(param_dtype)
        short = f"{dtype_name.replace('float', 'f')}-{kind}"
        if only is not None and short not in only:
            continue
        name = f"model[{dtype_name} params, {'compiled' if compiled else 'eager'}"
        name += ", grad ckpt" if checkpointing else ""
        name += "]" if token_major else ", HF attention layout]"

        def run(
            param_dtype=param_dtype, compiled=compiled, checkpointing=checkpointing, name=name,
            token_major=token_major,
        ):  # fmt: skip
            ms, opt_ms, note = model_fwd_bwd(
                path,
                batch,
                device=device,
                param_dtype=param_dtype,
                compiled=compiled,
                checkpointing=checkpointing,
                timing=timing,
                backend=backend,
                profile=args.profile is not None,
                token_major=token_major,
            )
            optimizer_ms.setdefault(param_dtype, opt_ms)
            if "\n" in note:  # the profile: to its file, not into the table
                note, profile = note.split("\n", 1)
                profiles.append(f"## {name} ({tokens} tokens)\n{profile}\n")
            return ms, note

        record(name, run)
    for param_dtype, ms in optimizer_ms.items():
        record(
            f"adamw_step[{dtype_label(param_dtype)} params]", lambda ms=ms: (ms, "once per mini-batch"), False
        )

    print(
        f"\n{device_name}, {seqs} sequences, {tokens} tokens ({response_tokens} response), "
        f"{model_params / 1e6:.0f}M params, {flops / 1e12:.2f} TFLOP counted, peak {peak}\n"
    )
    print("| variant | ms | TFLOP/s | MFU | note |\n|---|---:|---:|---:|---|")
    for r in rows:
        cells = [f"{r['ms']:.1f}" if r["ms"] else "-", f"{r['tflops']:.3g}" if r["tflops"] else "-"]
        cells.append(f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-")
        print(f"| {r['variant']} | {' | '.join(cells)} | {r['note']} |")
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text("\n".join(profiles))
        print("\n".join(profiles))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"device": device_name, "tokens": tokens, "response_tokens": response_tokens}
        summary |= {"num_params": model_params, "counted_flops": flops, "peak_flops": peak, "rows": rows}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
