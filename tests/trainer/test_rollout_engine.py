"""The built-in engine on CPU (plain torch path): the same scheduler, sampler rule and forward as on GPU.

Models are tiny and random, initialised with a wide weight spread (initializer_range 0.2) so that greedy
decoding does not just repeat one token: equality with transformers then means something.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2ForCausalLM, Qwen3Config

from trainer.batch import TrainBatch
from trainer.rollout.base import SamplingParams
from trainer.rollout.builtin import EngineConfig, load_engine
from trainer.rollout.builtin.engine import EngineStateError
from trainer.rollout.builtin.sampler import sampling_floors, token_seeds, torch_sample
from trainer.rollout.builtin.worker import EngineWorker
from trainer.rollout.local import LocalReplica
from trainer.rollout.manager import RolloutManager
from trainer.rollout.pool import ReplicaPool
from testing.tiny import char_tokenizer, tiny_qwen2_config
from trainer.tracking import rollout_logprob_gap
from trainer.workers.policy import response_logprobs

QUESTIONS = ["What is 2+3?", "hi", "Name a colour, then stop.", "Count: 1 2 3 4 5 6 7", "x"]


def varied_model(arch: str = "qwen2", seed: int = 0, vocab: int | None = None):
    """A tiny random causal LM whose greedy continuations vary (fp32, eval mode)."""
    tok = char_tokenizer()
    base = tiny_qwen2_config(vocab=vocab or len(tok), hidden=64, layers=2, heads=4, kv_heads=2)
    if arch == "qwen2":
        config = base
    else:
        cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
        fields = base.to_dict()
        fields.pop("model_type", None)
        fields.pop("architectures", None)
        config = cls(**fields)
        if arch == "qwen3":
            config.head_dim = 32  # Qwen3 sets head_dim explicitly (here hidden / heads as well)
    config.initializer_range = 0.2
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config) if arch == "qwen2" else AutoModelForCausalLM.from_config(config)
    return model.eval(), tok


def encode(tok, questions=QUESTIONS) -> list[list[int]]:
    return [tok(q)["input_ids"] for q in questions]


def engine_for(model, tok, **config):
    config = {"max_running": 8, "context_length": 96, **config}
    weight = next(model.parameters())
    return load_engine(
        model, tokenizer=tok, dtype=weight.dtype, device=weight.device, config=EngineConfig(**config)
    )


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def qwen():
    return varied_model("qwen2", seed=3)


# ------------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_equals_transformers_generate(arch):
    model, tok = varied_model(arch, seed=1)
    prompts = encode(tok)
    outputs = engine_for(model, tok).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    )
    seen = set()
    for prompt, (sample,) in zip(prompts, outputs):
        expected = hf_greedy(model, prompt, 24)
        assert sample.token_ids == expected
        assert sample.finish_reason == "length" and sample.matched == 24
        seen |= set(expected)
    assert len(seen) > 8  # continuations worth comparing, not one token repeated


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=1),
        SamplingParams(temperature=0.7, max_new_tokens=16, n=2, seed=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=16, n=2, seed=3),
        SamplingParams(temperature=0, max_new_tokens=16, n=2),
    ],
)
def test_logprobs_agree_with_the_trainers_recomputation(qwen, sampling):
    """Through the rollout manager over the in-process replica, as the trainer uses it."""
    model, tok = qwen
    replica = LocalReplica(EngineWorker(engine_for(model, tok)), with_text=False)
    manager = RolloutManager(ReplicaPool([replica]))
    try:
        rollouts = manager.generate(encode(tok), sampling)
    finally:
        manager.close()
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(QUESTIONS)) for _ in range(sampling.n)]
    batch = TrainBatch.from_rollouts(rollouts, tok.pad_token_id)
    with torch.no_grad():
        recomputed = response_logprobs(model, batch, temperature=sampling.temperature or 1.0).logprobs
    torch.testing.assert_close(batch.rollout_logprobs, recomputed * batch.response_mask, rtol=0, atol=2e-5)
    gap = rollout_logprob_gap(batch.rollout_logprobs, recomputed, batch.response_mask)
    assert gap["training/rollout_probs_diff_max"] < 1e-4 and gap["training/rollout_probs_diff_valid"] == 1.0
    # a wrong temperature is a visible gap: the metric would catch an engine that ignores it
    if sampling.temperature not in (0, 1.0):
        with torch.no_grad():
            untempered = response_logprobs(model, batch, temperature=1.0).logprobs
        assert (
            rollout_logprob_gap(batch.rollout_logprobs, untempered, batch.response_mask)[
                "training/rollout_probs_diff_max"
            ]
            > 1e-2
        )


@pytest.mark.parametrize("home", ["fit loop", "own thread"])
def test_async_requests_get_the_tokens_of_one_batch_call_and_one_can_be_cancelled(qwen, home):
    """The fit loop's requests (generate_async), with the manager on that loop (the trainer's way) or on
    its own thread: the prompts get the tokens one blocking batch call gives, prompt by prompt, and a
    request cancelled by its caller ends without its answer while the others finish. On the fit loop
    the blocking form is refused (it would wait on the loop it blocks)."""
    model, tok = qwen
    sampling = SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=5)
    prompts = encode(tok)

    def manager_on(loop):
        # a context long enough that the request cancelled below is still running 50 ms in, on any machine
        engine = engine_for(model, tok, context_length=1024)
        replica = LocalReplica(EngineWorker(engine), with_text=False)
        return RolloutManager(ReplicaPool([replica]), loop=loop)

    async def fit_loop():
        manager = manager_on(asyncio.get_running_loop() if home == "fit loop" else None)
        try:
            together = await asyncio.gather(
                *(manager.generate_async([p], sampling, first_index=i) for i, p in enumerate(prompts))
            )
            long = asyncio.ensure_future(
                manager.generate_async([prompts[0]], SamplingParams(max_new_tokens=1000, ignore_eos=True))
            )
            short = asyncio.ensure_future(manager.generate_async([prompts[1]], sampling, first_index=1))
            await asyncio.sleep(0.05)
            long.cancel()
            if home == "fit loop":
                with pytest.raises(RuntimeError, match="blocking calls cannot run on its own event loop"):
                    manager.generate(prompts, sampling)
            return together, await short, await asyncio.gather(long, return_exceptions=True)
        finally:
            await manager.close_async()

    together, short, (cancelled,) = asyncio.run(fit_loop())
    blocking = manager_on(None)
    try:
        alone = blocking.generate(prompts, sampling)
    finally:
        blocking.close()
    tokens = [
        [r.response_ids.tolist() for r in group] for group in together
    ]  # logprobs vary with the batch's rows
    assert [t for group in tokens for t in group] == [r.response_ids.tolist() for r in alone]
    assert [r.prompt_index for group in together for r in group] == [r.prompt_index for r in alone]
    assert [r.response_ids.tolist() for r in short] == tokens[1] and isinstance(
        cancelled, asyncio.CancelledError
    )


def test_continuous_batching_gives_each_request_the_tokens_it_gets_alone(qwen):
    model, tok = qwen
    prompts = encode(tok, QUESTIONS * 2)
    lengths = [5, 17, 9, 30, 3, 12, 22, 7, 26, 14]
    # 3 slots for 10 requests of different lengths: sequences join and leave between steps
    engine = engine_for(model, tok, max_running=3, max_prefill_tokens=40)
    handles = []
    for prompt, length in zip(prompts, lengths):
        handles.append([])
        engine.add(
            prompt, SamplingParams(temperature=0, max_new_tokens=length, ignore_eos=True), handles[-1].extend
        )
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert len(engine.running) <= 3
    assert steps < sum(lengths)  # decoded together, not one request after another
    for prompt, length, (sample,) in zip(prompts, lengths, handles):
        assert sample.token_ids == hf_greedy(model, prompt, length)
    # seeded sampling is batch-independent too: a sequence's noise depends on its seed and position only
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    together = engine.generate(prompts[:5], sampled)
    alone = [engine_for(model, tok, max_running=1).generate([p], sampled)[0] for p in prompts[:5]]
    assert [s[0].token_ids for s in together] == [s[0].token_ids for s in alone]


def test_n_samples_share_one_prefill(qwen):
    model, tok = qwen
    prompts = encode(tok)
    engine = engine_for(model, tok)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, n=3, ignore_eos=True))
    for prompt, samples in zip(prompts, greedy):
        assert len(samples) == 3
        assert all(s.token_ids == hf_greedy(model, prompt, 10) for s in samples)  # copied KV is right
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=4, seed=0, ignore_eos=True))
    assert all(len({tuple(s.token_ids) for s in samples}) > 1 for samples in sampled)  # distinct samples


def test_the_prompts_requested_in_one_turn_of_a_loop_are_prefilled_together(qwen):
    """The worker hands the engine a turn's requests as one item: one prefill for the batch, then the
    decode steps. One item a request, the engine thread started on the first alone (on a GPU host ~0.2 s
    before the others, the loop taking turns with it at the GIL). A request cancelled before its turn
    ended never reaches the engine."""
    model, tok = qwen
    prompts = encode(tok)
    engine = engine_for(model, tok, max_running=16, context_length=256)
    prefills: list[int] = []
    launch = engine._launch_prefill

    def counted(requests, width):
        prefills.append(len(requests))
        return launch(requests, width)

    engine._launch_prefill = counted  # counts, then runs the engine's own prefill
    worker = EngineWorker(engine)
    sampling = SamplingParams(temperature=0, max_new_tokens=8, n=2, ignore_eos=True)

    async def request(prompt):
        checked = time.perf_counter() + 0.002  # what a replica does first (validation), holding the GIL
        while time.perf_counter() < checked:
            pass
        return await worker.generate(prompt, sampling)

    async def one_turn():
        return await asyncio.gather(*(request(p) for p in prompts))

    async def cancel_one():
        long = dataclasses.replace(sampling, max_new_tokens=200)
        tasks = [
            asyncio.ensure_future(worker.generate(prompts[0], long)),
            asyncio.ensure_future(one(prompts[1])),
        ]
        await asyncio.sleep(0)  # both requests made, their turn not over
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def one(prompt):
        return await worker.generate(prompt, sampling)

    try:
        outputs = asyncio.run(one_turn())
        assert prefills == [len(prompts)], prefills
        assert [[s.token_ids for s in samples] for samples in outputs] == [
            [hf_greedy(model, p, 8)] * 2 for p in prompts
        ]
        cancelled, finished = asyncio.run(cancel_one())
        assert isinstance(cancelled, asyncio.CancelledError) and len(finished[0].token_ids) == 8
        assert not engine.has_work  # the cancelled request's 200 tokens were never started
    finally:
        worker.close()


def test_seed_reproduces_and_unseeded_follows_the_torch_rng(qwen):
    model, tok = qwen
    prompts = encode(tok)

    def run(seed):
        sampling = SamplingParams(max_new_tokens=8, n=2, seed=seed, ignore_eos=True)
        return [[s.token_ids for s in g] for g in engine_for(model, tok).generate(prompts, sampling)]

    assert run(7) == run(7) != run(8)
    torch.manual_seed(0)
    first = run(None)
    torch.manual_seed(0)
    assert run(None) == first


# ------------------------------------------------------------------------------------ stops


def sampled_continuation(model, tok, prompt, length, seed=123):
    (sample,) = engine_for(model, tok).generate(
        [prompt], SamplingParams(max_new_tokens=length, seed=seed, ignore_eos=True)
    )[0]
    return sample.token_ids


def test_stop_token_ends_the_response_right_after_it(qwen):
    model, tok = qwen
    prompt = encode(tok)[0]
    continuation = sampled_continuation(model, tok, prompt, 20)
    position = next(i for i in range(3, 20) if continuation[i] not in continuation[:i])
    stop_id = continuation[position]
    sampling = SamplingParams(max_new_tokens=20, stop_token_ids=(stop_id,), seed=123, ignore_eos=True)
    (sample,) = engine_for(model, tok).generate([prompt], sampling)[0]
    assert sample.token_ids == continuation[: position + 1]
    assert (sample.finish_reason, sample.matched) == ("stop", stop_id)
    # eos stops by default; ignore_eos keeps going (stop_token_ids still apply)
    engine = load_engine(
        model, tokenizer=tok, config=EngineConfig(max_running=4, context_length=96), eos_token_ids=[stop_id]
    )
    (stopped,) = engine.generate([prompt], SamplingParams(max_new_tokens=20, seed=123))[0]
    assert stopped.token_ids == continuation[: position + 1]
    (ignored,) = engine.generate([prompt], SamplingParams(max_new_tokens=20, seed=123, ignore_eos=True))[0]
    assert ignored.token_ids == continuation and ignored.finish_reason == "length"


def test_stop_string_spanning_tokens(qwen):
    model, tok = qwen
    prompt = encode(tok)[1]
    seed, continuation = next(
        (seed, c) for seed in range(200) if min(c := sampled_continuation(model, tok, prompt, 20, seed)) >= 4
    )
    text = tok.decode(continuation)
    end = next(i for i in range(4, 20) if text[i - 2 : i + 1] not in text[:i])
    stop = text[end - 2 : end + 1]
    sampling = SamplingParams(max_new_tokens=20, stop=(stop, "@@@@"), seed=seed, ignore_eos=True)
    (sample,) = engine_for(model, tok).generate([prompt], sampling)[0]
    assert sample.token_ids == continuation[: end + 1]
    assert (sample.finish_reason, sample.matched) == ("stop", stop)


def test_requests_with_different_stops_in_one_batch(qwen):
    """Per-sequence stop ids: one request's stop token does not stop its neighbour."""
    model, tok = qwen
    prompt = encode(tok)[0]
    continuation = sampled_continuation(model, tok, prompt, 20)
    stop_id = continuation[4]
    engine = engine_for(model, tok)
    results = {}
    engine.add(
        prompt, SamplingParams(max_new_tokens=20, seed=123, ignore_eos=True), lambda o: results.update(a=o)
    )
    engine.add(
        prompt,
        SamplingParams(max_new_tokens=20, seed=123, ignore_eos=True, stop_token_ids=(stop_id,)),
        lambda o: results.update(b=o),
    )
    while engine.has_work:
        engine.step()
    assert results["a"][0].token_ids == continuation
    first = continuation.index(stop_id)
    assert results["b"][0].token_ids == continuation[: first + 1]


# ------------------------------------------------------------------------------------ weights, memory


def test_load_weights_changes_the_outputs(qwen):
    model, tok = qwen
    other, _ = varied_model("qwen2", seed=99)
    prompts = encode(tok)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine = engine_for(model, tok)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    engine.load_weights(other.state_dict())
    after = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    assert after != before
    assert after == [hf_greedy(other, p, 12) for p in prompts]
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown weights"):
        engine.load_weights({"model.nonsense.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({"model.norm.weight": torch.ones(64)}, strict=True)
    # a bucket (a subset of the weights, the tied names both present) updates just those weights
    engine.load_weights(model.state_dict())
    bucket = {
        k: v for k, v in other.state_dict().items() if k in ("model.embed_tokens.weight", "lm_head.weight")
    }
    assert engine.load_weights(bucket) == 2
    assert torch.equal(engine.model.embed, other.model.embed_tokens.weight)
    assert torch.equal(engine.model.final_norm, model.model.norm.weight)


def test_release_and_resume_memory(qwen):
    model, tok = qwen
    prompts = encode(tok)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    engine = engine_for(model, tok)
    expected = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    engine.release(["kv_cache"])
    assert engine.cache is None and engine.released == {"kv_cache"}
    with pytest.raises(EngineStateError, match="released"):
        engine.add(prompts[0], greedy)
    engine.resume(["kv_cache"])
    assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == expected
    engine.release()  # both tags: the weights go to host memory
    assert engine.released == {"kv_cache", "weights"}
    with pytest.raises(EngineStateError):
        engine.load_weights(model.state_dict())
    engine.resume()
    assert not engine.released
    assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == expected
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release(["everything"])
    engine.add(prompts[0], greedy)
    with pytest.raises(EngineStateError, match="running"):
        engine.release()


def test_release_right_after_the_last_request_stops(qwen):
    """A stop token read back while the next step is already launched leaves that launch pending with
    every request done: release waits for it instead of refusing (a 4 x H200 run stopped at its step
    166 with "cannot release memory while requests are running")."""
    model, tok = qwen
    prompt = encode(tok)[0]
    continuation = sampled_continuation(model, tok, prompt, 20)
    stop_id = continuation[next(i for i in range(3, 20) if continuation[i] not in continuation[:i])]
    engine = engine_for(model, tok)
    sampling = SamplingParams(max_new_tokens=20, stop_token_ids=(stop_id,), seed=123, ignore_eos=True)
    ((sample,),) = engine.generate([prompt], sampling)
    assert sample.finish_reason == "stop" and engine.pending and not engine.running
    engine.release(["kv_cache"])
    assert not engine.has_work and engine.released == {"kv_cache"}
    engine.resume(["kv_cache"])
    assert engine.generate([prompt], sampling)[0][0].token_ids == sample.token_ids


def test_abort_finishes_a_request_at_once(qwen):
    model, tok = qwen
    engine = engine_for(model, tok, max_running=2)
    got = {}
    engine.add(
        encode(tok)[0], SamplingParams(max_new_tokens=50, ignore_eos=True), lambda o: got.update(a=o), rid="a"
    )
    engine.add(
        encode(tok)[1],
        SamplingParams(max_new_tokens=50, n=2, ignore_eos=True),
        lambda o: got.update(b=o),
        rid="b",
    )
    engine.step()
    engine.step()
    assert engine.abort("b") and not engine.abort("nope")
    assert [s.finish_reason for s in got["b"]] == ["abort", "abort"]
    while engine.has_work:
        engine.step()
    assert got["a"][0].finish_reason == "length" and len(got["a"][0].token_ids) == 50


def test_bad_requests_are_clear_errors(qwen):
    model, tok = qwen
    engine = engine_for(model, tok, max_running=4, context_length=32)
    sampling = SamplingParams(max_new_tokens=8)
    with pytest.raises(ValueError, match="empty"):
        engine.add([], sampling)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        engine.add([5, 10_000], sampling)
    with pytest.raises(ValueError, match="context length 32"):
        engine.add([5] * 30, sampling)
    with pytest.raises(ValueError, match="max_running=4"):
        engine.add([5], SamplingParams(max_new_tokens=2, n=5))
    no_tokenizer = load_engine(model, config=EngineConfig(max_running=2, context_length=32))
    with pytest.raises(ValueError, match="tokenizer"):
        no_tokenizer.add([5], SamplingParams(max_new_tokens=2, stop=("ab",)))
    assert not engine.has_work


# ------------------------------------------------------------------------------------ sampler


def test_token_seeds_are_deterministic_and_distinct():
    base = np.array([1, 1, 2], dtype=np.int64)
    first = token_seeds(base, np.array([0, 1, 0]))
    assert (first >= 0).all() and len(set(first.tolist())) == 3
    assert (token_seeds(base, np.array([0, 1, 0])) == first).all()


def test_sampling_floors_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [1.0, 3.0, 0.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    temps = torch.tensor([1.0, 1.0, 1.0])
    inf = float("-inf")
    # row 0: top-k 2 -> floor 2.0; row 1: softmax sorted [0.644, 0.237, 0.087, 0.032], top-p 0.8 keeps
    # two (mass before the 3rd is 0.881 >= 0.8) -> floor 2.0; row 2: no limit
    floors = sampling_floors(logits, temps, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.8, 1.0]))
    assert floors.tolist() == [2.0, 2.0, inf]
    # top-p 0.5 keeps only the best; temperature 2 flattens: [0.448, 0.272, 0.165, 0.100] keeps 3 at 0.8
    floors = sampling_floors(
        logits[:2], torch.tensor([1.0, 2.0]), torch.tensor([-1, -1]), torch.tensor([0.5, 0.8])
    )
    assert floors.tolist() == [3.0, 1.0]


def test_torch_sample_follows_the_distribution_and_reports_its_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    temps = torch.full((4000,), 0.5)
    seeds = torch.from_numpy(token_seeds(np.arange(4000), np.zeros(4000, dtype=np.int64)))
    tokens, logprobs = torch_sample(logits, temps, seeds, None)
    expected = torch.softmax(logits[0] / 0.5, dim=-1)  # [0.865, 0.117, 0.016, 0.002]
    observed = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(observed, expected, atol=0.02)
    torch.testing.assert_close(logprobs, torch.log(expected)[tokens], rtol=0, atol=1e-6)
    floors = torch.full((4000,), 1.0)  # only the two best may be drawn
    tokens, _ = torch_sample(logits, temps, seeds, floors)
    assert set(tokens.tolist()) == {0, 1}
    greedy_tokens, greedy_logprobs = torch_sample(logits[:2], torch.zeros(2), seeds[:2], None)
    assert greedy_tokens.tolist() == [0, 0]
    torch.testing.assert_close(greedy_logprobs, torch.log_softmax(logits[0], -1)[[0, 0]])
