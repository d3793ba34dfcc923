"""The built-in fast engine: own forward pass, slotted KV cache, continuous batching, CUDA graphs (GPU).

`load_engine(path_or_model, ...)` builds one from a transformers checkpoint folder or a live model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from trainer.rollout.builtin.engine import BuiltinEngine, EngineConfig
from trainer.rollout.builtin.model import EngineModel, ModelShape

__all__ = ["EngineConfig", "checkpoint_tensors", "default_eos_ids", "load_engine"]


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every *.safetensors file in a checkpoint folder, on CPU."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_engine(
    source,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    device=None,
    config: EngineConfig | None = None,
    eos_token_ids=None,
) -> BuiltinEngine:
    """A ready engine, its weights from a checkpoint folder or a live transformers model. dtype: bf16 on
    CUDA, fp32 on CPU by default. eos_token_ids: the tokenizer's eos and the checkpoint's generation-config
    eos ids by default (Qwen-Instruct: <|im_end|>, <|endoftext|>).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if eos_token_ids is None:
        eos_token_ids = default_eos_ids(source, tokenizer)
    if isinstance(source, (str, Path)):
        from transformers import AutoConfig

        model = EngineModel(ModelShape.from_config(AutoConfig.from_pretrained(source)), dtype, device)
        model.load(dict(checkpoint_tensors(source)))
    else:
        model = EngineModel(ModelShape.from_config(source.config), dtype, device)
        model.load(source.state_dict())
    return BuiltinEngine(model, tokenizer, config, eos_token_ids)


def default_eos_ids(source, tokenizer) -> tuple[int, ...]:
    """The tokenizer's eos plus the generation config's eos ids (Qwen-Instruct: <|im_end|> and
    <|endoftext|>); source: a model, or a checkpoint folder to read generation_config.json from."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    if isinstance(source, (str, Path)):
        from transformers import GenerationConfig

        try:
            configured = GenerationConfig.from_pretrained(source).eos_token_id
        except OSError:  # no generation_config.json
            configured = None
    else:
        configured = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
