"""The neural reward model scorer, with a tiny randomly initialised Qwen2 classifier made here (no hub).

What is checked is plumbing, not quality: the server's score is the model's logit for the chat-formatted
pair, it is deterministic, and batching (with padding) does not change it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.helpers import ROOT, service_process

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "far",
    "what",
    "is",
    "two",
    "plus",
    "three",
    "five",
    "four",
    "it",
    "answer",
    "I",
    "think",
    "so",
    "maybe",
    "no",
    "yes",
    "question",
    "please",
    "tell",
    "me",
    "quickly",
    "very",
    "long",
    "response",
    "with",
    "many",
    "words",
    "here",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> {% endfor %}"
)
PAIRS = [
    ("what is two plus three", "five"),
    ("what is two plus three", "it is four I think"),
    ("tell me", "the cat sat on the mat"),
    ("please", "yes"),
    ("question", "no no no no no no no no no no no no"),
    ("what is two plus three", "the answer is five"),
    ("tell me quickly", "maybe"),
    ("the dog", "the dog ran far very far"),
    ("please tell me", "very long response with many words here " * 4),
    ("what", "so"),
    ("", "a cat"),
    ("tell me", "unknownword and five"),
]


def make_tokenizer(chat_template: str | None):
    """A byte-level BPE learned from WORDS: every byte is in the vocabulary, so no text is ever dropped
    (transformers rebuilds any tokenizer saved beside a Qwen2 config as a byte-level Qwen2Tokenizer)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = make_tokenizer(CHAT_TEMPLATE)
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    args = [
        "--reward-model",
        str(model_dir),
        "--model-batch-size",
        "4",
        "--math-workers",
        "1",
        "--log-level",
        "warning",
    ]
    with service_process("services.reward_server", *args) as (url, _):
        yield url


def model_items(pairs):
    return [
        {"data_source": "anything", "prompt": p, "response": r, "ground_truth": "", "scorer": "model"}
        for p, r in pairs
    ]


def post(url, items):
    response = httpx.post(url + "/v1/rewards", json={"items": items}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def reference_scores(model_dir, pairs) -> list[float]:
    """The logit of each pair alone, computed here straight from transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for prompt, response in pairs:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.inference_mode():
            scores.append(model(**ids).logits[0, 0].item())
    return scores


def test_scores_are_the_models_logits_batched_or_not(server, model_dir):
    batched = post(server, model_items(PAIRS))  # 12 pairs of mixed lengths, 3 padded micro-batches of 4
    one_by_one = [post(server, model_items([pair]))[0] for pair in PAIRS]
    expected = reference_scores(model_dir, PAIRS)
    assert [r["score"] for r in batched] == pytest.approx(expected, abs=1e-5)
    assert [r["score"] for r in one_by_one] == pytest.approx(expected, abs=1e-5)
    assert post(server, model_items(PAIRS)) == batched  # deterministic, to the bit
    assert len({round(s, 5) for s in expected}) == len(PAIRS)  # a real function of the text, not a constant
    assert [r["correct"] for r in batched] == [s > 0 for s in expected]
    assert all(r["error"] is None and r["extracted"] is None for r in batched)


def test_model_and_rule_items_share_a_batch(server):
    results = post(
        server,
        [*model_items(PAIRS[:2]), {"data_source": "openai/gsm8k", "response": "#### 5", "ground_truth": "5"}],
    )
    assert results[2]["score"] == 1.0 and results[2]["extracted"] == "5"
    assert results[0]["score"] != results[1]["score"]
    listed = httpx.get(server + "/v1/scorers").json()["scorers"]
    assert {s["name"]: s["available"] for s in listed}["model"] is True


def test_local_scorer_matches_the_server_and_pair_encoding_batches_too(server, model_dir, tmp_path):
    from services.scoring import LocalScorer
    from services.reward_server.schemas import RewardItem

    expected = [r["score"] for r in post(server, model_items(PAIRS))]
    items = [RewardItem(**item) for item in model_items(PAIRS)]

    async def score(path, batch_size):
        async with LocalScorer(reward_model=str(path), model_batch_size=batch_size, math_workers=1) as scorer:
            return [r.score for r in await scorer.score(items)]

    assert asyncio.run(score(model_dir, 5)) == pytest.approx(expected, abs=1e-5)
    # A tokenizer without a chat template: (prompt, response) go in as a text pair, BERT-style.
    plain = tmp_path / "plain"
    transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).save_pretrained(plain)
    make_tokenizer(None).save_pretrained(plain)
    assert asyncio.run(score(plain, 5)) == pytest.approx(asyncio.run(score(plain, 1)), abs=1e-5)


def test_missing_model_path_fails_the_start_with_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.reward_server",
            "--port",
            "0",
            "--reward-model",
            str(tmp_path / "missing"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: --reward-model {tmp_path / 'missing'} does not exist"
    ]


@pytest.mark.gpu
def test_gpu_scores_match_cpu_and_batching_holds_in_bfloat16(model_dir):
    # Imports only the model scorer (torch + transformers), so this runs on a bare GPU machine.
    from services.scoring.model import RewardModel

    prompts, responses = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    cpu = RewardModel(str(model_dir), device="cpu", batch_size=4).score(prompts, responses)
    gpu_fp32 = RewardModel(str(model_dir), device="cuda", dtype="float32", batch_size=4)
    assert gpu_fp32.score(prompts, responses) == pytest.approx(cpu, abs=1e-4)
    gpu_bf16 = RewardModel(str(model_dir), device="auto", batch_size=4)  # auto on a GPU: cuda, bfloat16
    assert gpu_bf16.device == "cuda" and gpu_bf16.model.dtype == torch.bfloat16
    batched = gpu_bf16.score(prompts, responses)
    one_by_one = [gpu_bf16.score([p], [r])[0] for p, r in PAIRS]
    assert batched == pytest.approx(one_by_one, abs=2e-2)
    assert batched == pytest.approx(cpu, abs=5e-2)
