"""The built-in engine's GPU fast path (compiled Triton kernels, CUDA graphs). Run on the device:

python -m pytest -q -m gpu tests/trainer/test_rollout_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_rollout_engine import QUESTIONS, encode, engine_for, hf_greedy, varied_model
from tests.trainer.test_rollout_kernels import check_fused_engine, check_kernels
from trainer.batch import TrainBatch
from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.metrics import rollout_logprob_gap
from trainer.workers.policy import response_logprobs

pytestmark = pytest.mark.gpu


def test_compiled_kernels_match_the_torch_path():
    check_kernels("cuda", torch.float32, atol=1e-4)
    check_kernels("cuda", torch.bfloat16, atol=3e-2)


def test_graphs_and_fused_path_reproduce_transformers_greedy_in_fp32():
    check_fused_engine("cuda")


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
