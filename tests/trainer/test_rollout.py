"""The built-in rollout engine on a tiny random Qwen2 with the char tokenizer, and TrainBatch's layout.

The engine's logprobs are checked against a teacher-forced forward of the same tokens (what the
trainer recomputes), stops and finish reasons against a greedy continuation computed beforehand.
"""

import pickle
import random

import numpy as np
import pytest
import torch

from trainer.batch import TrainBatch
from trainer.model import load_policy, load_tokenizer
from trainer.rollout import Rollout, SamplingParams
from trainer.rollout.hf_engine import HFRolloutEngine
from testing.tiny import make_tiny_model
from trainer.workers.logprobs import response_logprobs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, seed=11))
    return load_policy(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    questions = ["What is 2+3?", "hi", "Name a colour, then stop."]  # different lengths: left padding
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]


def engine(tiny, **kwargs):
    model, tok = tiny
    return HFRolloutEngine(model, tok, **kwargs)


def seeded_continuation(tiny, prompt, length, seed=123):
    """A sampled continuation with every stop disabled; the same seed replays it token for token.

    (Greedy decoding of a random tiny model just repeats one token, which cannot test stops.)
    """
    (rollout,) = engine(tiny, eos_token_ids=()).generate(
        [prompt], SamplingParams(max_new_tokens=length, seed=seed)
    )
    return rollout.response_ids.tolist()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=1),
        SamplingParams(temperature=0.7, max_new_tokens=12, n=2, seed=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12, n=2, seed=3),
    ],
)
def test_engine_logprobs_equal_teacher_forced_recomputation(tiny, prompts, sampling):
    model, tok = tiny
    rollouts = engine(tiny).generate(prompts, sampling)
    batch = TrainBatch.from_rollouts(rollouts, tok.pad_token_id)
    with torch.no_grad():
        recomputed = response_logprobs(model, batch, temperature=sampling.temperature).logprobs
    torch.testing.assert_close(batch.rollout_logprobs, recomputed * batch.response_mask, rtol=0, atol=2e-5)
    # logprobs are of the full tempered distribution, not the top-k/top-p truncated one: all < 0 here
    assert (batch.rollout_logprobs[batch.response_mask.bool()] < 0).all()


def test_n_samples_come_out_grouped_by_prompt(tiny, prompts):
    rollouts = engine(tiny).generate(prompts, SamplingParams(max_new_tokens=4, n=3, seed=0))
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(r.prompt_ids.tolist() == prompts[r.prompt_index] for r in rollouts)
    assert all(len(r.response_ids) == len(r.logprobs) == len(r.loss_mask) for r in rollouts)
    batch = TrainBatch.from_rollouts(rollouts, 0)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_greedy_is_deterministic_and_picks_the_argmax(tiny, prompts):
    model, tok = tiny
    sampling = SamplingParams(temperature=0, max_new_tokens=10, n=2)
    first = engine(tiny).generate(prompts, sampling)
    second = engine(tiny, max_batch_size=2).generate(prompts, sampling)  # other batch composition too
    assert [r.response_ids.tolist() for r in first] == [r.response_ids.tolist() for r in second]
    assert first[0].response_ids.tolist() == first[1].response_ids.tolist()  # n greedy samples are identical
    batch = TrainBatch.from_rollouts(first, tok.pad_token_id)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
    start = batch.prompt_width - 1
    argmax = logits[:, start : start + batch.response_width].argmax(-1)
    mask = batch.response_mask.bool()
    assert torch.equal(argmax[mask], batch.responses[mask])
    # greedy logprobs are those of the untempered model
    recomputed = response_logprobs(model, batch, temperature=1.0).logprobs
    torch.testing.assert_close(batch.rollout_logprobs, recomputed * batch.response_mask, rtol=0, atol=2e-5)


def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(tiny, prompts):
    greedy = engine(tiny).generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    for sampling in (
        SamplingParams(top_k=1, max_new_tokens=8, seed=5),
        SamplingParams(top_p=1e-6, max_new_tokens=8, seed=5),
    ):
        sampled = engine(tiny).generate(prompts, sampling)
        assert [r.response_ids.tolist() for r in sampled] == [r.response_ids.tolist() for r in greedy]


def test_seed_reproduces_and_different_seeds_differ(tiny, prompts):
    def run(seed):
        return [
            r.response_ids.tolist()
            for r in engine(tiny).generate(prompts, SamplingParams(max_new_tokens=8, n=2, seed=seed))
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_seeded_prompt_samples_the_same_tokens_in_any_batch(tiny, prompts):
    """The rollout manager batches whatever requests arrive together: a prompt's samples must depend on
    its own seed only, not on its batch-mates (a generator per batch made runs unrepeatable)."""
    sampling = SamplingParams(max_new_tokens=8, n=2, top_k=20, top_p=0.95)
    together = engine(tiny).generate(prompts, sampling, seeds=[11, 12, 13][: len(prompts)])
    alone = [engine(tiny).generate([p], sampling, seeds=[s])[0:2] for p, s in zip(prompts, [11, 12, 13])]
    assert [r.response_ids.tolist() for r in together] == [
        r.response_ids.tolist() for pair in alone for r in pair
    ]
    assert (
        together[0].response_ids.tolist() != together[1].response_ids.tolist()
    )  # the n samples of a prompt differ


def test_stop_token_ends_the_response_right_after_it(tiny, prompts):
    continuation = seeded_continuation(tiny, prompts[0], 16)
    position = next(i for i in range(3, 16) if continuation[i] not in continuation[:i])  # first occurrence
    stop_id = continuation[position]
    (rollout,) = engine(tiny, eos_token_ids=()).generate(
        [prompts[0]], SamplingParams(max_new_tokens=16, stop_token_ids=(stop_id,), seed=123)
    )
    assert rollout.response_ids.tolist() == continuation[: position + 1]
    assert rollout.finish_reason == "stop" and rollout.loss_mask.tolist() == [1] * (position + 1)
    # the engine's default stops are the tokenizer's eos (<|im_end|>) and the generation config's
    _, tok = tiny
    assert engine(tiny).eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_stop_string_spanning_tokens_ends_the_response_after_its_last_token(tiny, prompts):
    _, tok = tiny
    # a seed whose continuation is all plain characters (one character per token, no special token)
    seed, continuation = next(
        (seed, c) for seed in range(100) if min(c := seeded_continuation(tiny, prompts[1], 20, seed)) >= 4
    )
    text = tok.decode(continuation)
    assert len(text) == 20
    end = next(i for i in range(4, 20) if text[i - 2 : i + 1] not in text[:i])  # first occurrence ends at i
    stop = text[end - 2 : end + 1]  # three tokens long
    (rollout,) = engine(tiny, eos_token_ids=()).generate(
        [prompts[1]], SamplingParams(max_new_tokens=20, stop=(stop, "@@@@"), seed=seed)
    )
    assert rollout.response_ids.tolist() == continuation[: end + 1]
    assert tok.decode(rollout.response_ids).endswith(stop) and rollout.finish_reason == "stop"


def test_length_finish_reason_and_max_new_tokens(tiny, prompts):
    rollouts = engine(tiny, eos_token_ids=()).generate(prompts, SamplingParams(max_new_tokens=5, seed=0))
    assert [len(r.response_ids) for r in rollouts] == [5, 5, 5]
    assert {r.finish_reason for r in rollouts} == {"length"}


def test_generate_restores_training_mode(tiny, prompts):
    model, _ = tiny
    model.train()
    engine(tiny).generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
    assert model.training


def test_bad_requests_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="empty"):
        engine(tiny).generate([[5, 6], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine(tiny).generate([[5, 1000]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="temperature.*top_p"):
        SamplingParams(temperature=-1, top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)


# -------------------------------------------------------------------------------------- TrainBatch


def rollout(prompt, response, loss_mask=None, index=0):
    return Rollout(
        prompt_ids=prompt,
        response_ids=response,
        logprobs=[-0.5] * len(response),
        loss_mask=loss_mask or [1] * len(response),
        finish_reason="stop",
        prompt_index=index,
    )


def test_train_batch_layout_by_hand():
    batch = TrainBatch.from_rollouts(
        [rollout([5, 6, 7], [9, 10], index=0), rollout([8], [11, 12, 13], [1, 0, 1], index=1)],
        pad_id=0,
        data_sources=["gsm8k", "math"],
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10, 0], [0, 0, 8, 11, 12, 13]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert batch.rollout_logprobs.tolist() == [[-0.5, -0.5, 0], [-0.5, -0.5, -0.5]]
    assert (batch.prompt_width, batch.response_width) == (3, 3)
    assert batch.responses.tolist() == [[9, 10, 0], [11, 12, 13]]
    assert batch.prompt_lengths.tolist() == [3, 1] and batch.response_lengths.tolist() == [2, 3]
    assert batch.group_ids.tolist() == [0, 1] and batch.data_sources == ("gsm8k", "math")
    # the second row alone: two columns of prompt padding go, the response keeps its 3 columns
    alone = batch.select([1]).trimmed()
    assert alone.input_ids.tolist() == [[8, 11, 12, 13]] and alone.position_ids.tolist() == [[0, 1, 2, 3]]
    first = batch.select([0]).trimmed()
    assert first.input_ids.tolist() == [[5, 6, 7, 9, 10]] and first.response_mask.tolist() == [[1, 1]]
    assert first.rollout_logprobs.tolist() == [[-0.5, -0.5]] and first.data_sources == ("gsm8k",)


def test_train_batch_rows_of_any_lengths_hold_each_rollout_where_the_layout_says():
    """Rows built all at once (ragged positions): every row's prompt ends at column P, its response,
    loss mask and logprobs follow, an empty response included."""
    rng = random.Random(0)
    rollouts = []
    for i in range(40):
        prompt = [rng.randrange(1, 99) for _ in range(rng.randrange(1, 9))]
        response = [rng.randrange(1, 99) for _ in range(rng.randrange(0, 7))]
        mask = [rng.randrange(2) for _ in response]
        rollouts.append(rollout(prompt, response, mask, index=i))
    batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
    width = batch.prompt_width
    for row, r in enumerate(rollouts):
        start, end = width - len(r.prompt_ids), width + len(r.response_ids)
        assert batch.input_ids[row, start:end].tolist() == r.prompt_ids.tolist() + r.response_ids.tolist()
        assert batch.input_ids[row, :start].eq(0).all() and batch.input_ids[row, end:].eq(0).all()
        assert batch.attention_mask[row].tolist() == [0] * start + [1] * (end - start) + [0] * (
            batch.input_ids.shape[1] - end
        )
        assert batch.response_mask[row, : len(r.loss_mask)].tolist() == r.loss_mask.tolist()
        assert batch.rollout_logprobs[row, : len(r.logprobs)].tolist() == r.logprobs.tolist()
        assert batch.response_mask[row, len(r.loss_mask) :].eq(0).all()


def test_train_batch_split_select_to_and_group_ids():
    rollouts = [rollout([1] * (i + 1), [2] * (5 - i), index=i // 2) for i in range(5)]
    batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
    assert batch.response_width == 5 and batch.group_ids.tolist() == [0, 0, 1, 1, 2]
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    reordered = batch.select(torch.tensor([4, 0]))
    assert reordered.prompt_lengths.tolist() == [5, 1] and reordered.group_ids.tolist() == [2, 0]
    assert batch.to("cpu").input_ids.device.type == "cpu"
    advantages = torch.ones(5, 5)
    assert batch.with_fields(advantages=advantages).split(3)[1].advantages.shape == (2, 5)
    assert batch.advantages is None  # with_fields made a new record
    with pytest.raises(ValueError, match="no rollouts"):
        TrainBatch.from_rollouts([], pad_id=0)


def test_shared_prefixes_groups_consecutive_samples():
    from trainer.rollout.hf_engine import shared_prefixes

    rows = [(0, [5, 6]), (0, [5, 6]), (1, [7]), (1, [7]), (1, [7]), (0, [5, 6])]
    unique, expand = shared_prefixes(rows)
    # runs: rows 0-1 (prompt 0), rows 2-4 (prompt 1), row 5 (prompt 0 again, a new run)
    assert unique == [0, 2, 5]
    assert expand.tolist() == [0, 0, 1, 1, 1, 2]


def test_packed_rollouts_come_back_exactly_as_sent():
    """What a Ray rank sends the driver (arrays, not lists): every value and field round-trips exactly,
    empty responses, tool-masked tokens and float64 logprobs included."""
    from trainer.rollout.base import pack_rollouts, unpack_rollouts

    rng = random.Random(0)
    rollouts = [
        Rollout(
            prompt_ids=[rng.randrange(150_000) for _ in range(rng.randrange(1, 9))],
            response_ids=[rng.randrange(150_000) for _ in range(length)],
            logprobs=[-rng.random() * 20 for _ in range(length)],
            loss_mask=[rng.randrange(2) for _ in range(length)],
            finish_reason=rng.choice(["stop", "length", "abort"]),
            prompt_index=index // 2,
        )
        for index, length in enumerate([0, 5, 1, 17])
    ]
    packed = pack_rollouts(rollouts)
    back = unpack_rollouts(pickle.loads(pickle.dumps(packed, protocol=5)))
    assert back == rollouts and back != rollouts[::-1]
    assert [r.logprobs.tolist() for r in back] == [r.logprobs.tolist() for r in rollouts]
    # the driver's rollouts are views into the message's columns, not copies (or Python lists)
    flat = back[0].response_ids.base
    assert all(r.response_ids.base is flat and r.response_ids.dtype == np.int64 for r in back)
    assert unpack_rollouts(pack_rollouts([])) == []
