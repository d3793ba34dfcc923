"""The built-in engine's GPU fast path (compiled Triton kernels, CUDA graphs). Run on the device:

python -m pytest -q -m gpu tests/trainer/test_rollout_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_rollout_engine import QUESTIONS, encode, engine_for, hf_greedy, varied_model
from tests.trainer.test_rollout_kernels import check_fused_engine, check_kernels
from trainer.rollout.builtin import kernels
from trainer.batch import TrainBatch
from trainer.rollout.base import Rollout, SamplingParams
from trainer.tracking import rollout_logprob_gap
from trainer.workers.policy import response_logprobs

pytestmark = pytest.mark.gpu


def test_compiled_kernels_match_the_torch_path():
    check_kernels("cuda", torch.float32, atol=1e-4)
    check_kernels("cuda", torch.bfloat16, atol=3e-2)


def test_graphs_and_fused_path_reproduce_transformers_greedy_in_fp32():
    check_fused_engine("cuda")


if kernels.triton is not None:
    from trainer.rollout.builtin.kernels import _inverse_cdf, tl

    @kernels.triton.jit
    def _aim_at_the_rounding_gap(logits_ptr, token_ptr, gap_ptr, BLOCK: tl.constexpr):
        """One block a row: the target set to the end of the block's own cumulative scan, which a tree
        sum of the same masses can exceed by rounding (then gap = 1)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * BLOCK
        raw = tl.load(base + tl.arange(0, BLOCK)).to(tl.float32)
        top = tl.max(raw, 0)
        mass = tl.where(raw >= float("-inf"), tl.exp(raw - top), 0.0)  # as _inverse_cdf computes it
        scan_end = tl.max(tl.cumsum(mass, 0), 0)
        tl.store(gap_ptr + row, (scan_end < tl.sum(mass, 0)).to(tl.int32))
        token = _inverse_cdf(base, 0, BLOCK, scan_end, float("-inf"), 1.0, top, 0, BLOCK)
        tl.store(token_ptr + row, token.to(tl.int64))


def test_sampling_never_picks_past_the_vocabulary_when_the_scan_and_the_sum_round_apart():
    """A block's masses summed by a tree (tl.sum) and by a scan (tl.cumsum) round apart. The kernel
    once judged "the draw falls in this block" by the sum and picked the entry by the scan; a target
    between the two matched no entry and it wrote `vocab`, one past the table: a device-side assert at
    the next step's embedding lookup (step 77 of a GSM8K run, a few million draws in). Aimed at that
    gap, every pick must still be a real entry."""
    rows, block = 4096, kernels.SAMPLE_CONFIG["BLOCK"]
    logits = (torch.randn(rows, block, generator=torch.Generator().manual_seed(0)) * 3).to(
        "cuda", torch.bfloat16
    )
    tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
    gap = torch.empty(rows, dtype=torch.int32, device="cuda")
    _aim_at_the_rounding_gap[(rows,)](
        logits, tokens, gap, BLOCK=block, num_warps=kernels.SAMPLE_CONFIG["num_warps"]
    )
    assert int(gap.sum()) > 0  # the rounding gap is there to aim at
    assert 0 <= int(tokens.min()) and int(tokens.max()) < block


def test_graph_replay_equals_eager_in_bf16():
    model, tok = varied_model("qwen2", seed=2)
    model = model.to("cuda", torch.bfloat16)
    prompts = encode(tok, QUESTIONS * 4)
    sampling = SamplingParams(temperature=0, max_new_tokens=24, n=2, ignore_eos=True)
    graphed = engine_for(model, tok, max_running=16, context_length=96)
    eager = engine_for(model, tok, max_running=16, context_length=96, cuda_graphs=False)
    assert graphed.use_graphs and not eager.use_graphs
    assert [[s.token_ids for s in g] for g in graphed.generate(prompts, sampling)] == [
        [s.token_ids for s in g] for g in eager.generate(prompts, sampling)
    ]


def test_bf16_logprobs_are_close_to_the_trainers_and_the_gap_is_logged():
    model, tok = varied_model("qwen2", seed=2)
    model = model.to("cuda", torch.bfloat16)
    prompts = encode(tok)
    engine = engine_for(model, tok, max_running=16, context_length=96)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, n=4, seed=0, ignore_eos=True)
    rollouts = []
    for index, samples in enumerate(engine.generate(prompts, sampling)):
        rollouts += [
            Rollout(prompts[index], s.token_ids, s.logprobs, [1] * len(s.token_ids), s.finish_reason, index)
            for s in samples
        ]
    batch = TrainBatch.from_rollouts(rollouts, tok.pad_token_id).to("cuda")
    with torch.no_grad():
        recomputed = response_logprobs(model, batch, temperature=1.0).logprobs
    gap = rollout_logprob_gap(batch.rollout_logprobs, recomputed, batch.response_mask)
    assert gap["training/rollout_probs_diff_mean"] < 0.01, gap
    assert gap["training/rollout_actor_probs_pearson_corr"] > 0.99, gap


@pytest.mark.parametrize("keep", [False, True], ids=["release-empties", "release-keeps"])
def test_rollout_phases_after_the_first_reserve_no_more_memory(keep):
    model, tok = varied_model("qwen2", seed=2)
    engine = engine_for(model.to("cuda"), tok, max_running=64, context_length=2048, keep_released_memory=keep)
    prompts = encode(tok)
    reserved = []
    for phase in range(5):  # a training run's rollout phases: each resume captures its graphs again
        for batch in (1, 3, 5):  # three graph buckets a phase
            engine.generate(prompts[:batch], SamplingParams(temperature=1.0, max_new_tokens=8, seed=phase))
        held, cache = torch.cuda.memory_allocated(), engine.cache.nbytes
        engine.release(["kv_cache"])
        assert torch.cuda.memory_allocated() < held  # the cache is free for this process's passes ...
        if keep:  # ... and stays in its allocator
            assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= cache
        reserved.append(torch.cuda.memory_reserved())
        mallocs = torch.cuda.memory_stats()["segment.all.allocated"]
        engine.resume(["kv_cache"])
        if keep:  # the cache comes back from the allocator's blocks: no empty_cache, no cudaMalloc
            assert torch.cuda.memory_stats()["segment.all.allocated"] == mallocs
    print("reserved after each release, MiB:", [r >> 20 for r in reserved])
    assert reserved[-1] <= reserved[1], "a phase must reuse what the last one left, not add to it"


def test_a_prompt_admitted_while_decoding_reaches_the_gpu_through_pinned_memory():
    # A pageable host-to-device copy first waits for the GPU's queued work: a multi-turn request's next
    # turn, admitted while other sequences decode, stalled the host behind their steps.
    from torch.profiler import ProfilerActivity, profile

    model, tok = varied_model("qwen2", seed=2)
    engine = engine_for(model.to("cuda"), tok, max_running=64, context_length=2048)
    prompts = encode(tok)
    sampled = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=8, n=2, seed=1)
    reference = engine.generate(prompts, sampled)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outputs = engine.generate(prompts, sampled)  # prefill (n=2: a prefix copy), top-k/top-p steps
        torch.cuda.synchronize()
    copies = [event.name for event in prof.events() if "Memcpy HtoD" in event.name]
    assert copies and not any("Pageable" in name for name in copies), copies
    assert [[s.token_ids for s in g] for g in outputs] == [[s.token_ids for s in g] for g in reference]


def test_release_frees_gpu_memory_and_resume_restores_the_outputs():
    model, tok = varied_model("qwen2", seed=2)
    engine = engine_for(model.to("cuda"), tok, max_running=64, context_length=2048)
    prompts = encode(tok)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    held = torch.cuda.memory_allocated()
    engine.release()
    assert torch.cuda.memory_allocated() < held - engine.model.nbytes  # the cache and the weights went
    engine.resume()
    assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == before
    assert before == [hf_greedy(model, p, 12) for p in prompts]


def test_prefills_of_new_shapes_run_no_cudnn_attention():
    """cuDNN's attention plans every new shape on the host (~60 ms a prefill with the GPU idle on an
    H200); an engine on CUDA turns it off for the process, so prefills of new [B, T] take flash."""
    model, tok = varied_model("qwen2", seed=2)
    engine = engine_for(model.to("cuda", torch.bfloat16), tok, max_running=16, context_length=96)
    sampling = SamplingParams(temperature=0, max_new_tokens=4, n=1, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for count in (1, 3, 5):  # three prefill shapes
            engine.generate(encode(tok, QUESTIONS[:count]), sampling)
    ops = {event.name for event in prof.events()}
    assert any("attention" in op for op in ops), sorted(ops)  # the prefill's SDPA was seen
    assert not any("cudnn_attention" in op for op in ops)
