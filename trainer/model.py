"""Load the policy, the critic, the frozen reference and the tokenizer.

`path` (actor_rollout_ref.model.path / critic.model.path) may be
- a local folder with config + safetensors + tokenizer (what `testing.tiny.make_tiny_model` writes),
- a local GGUF file (`.../model.Q4_1.gguf`; transformers de-quantises it to float, needs `gguf`),
- a hub id (`Qwen/Qwen2.5-0.5B-Instruct`), or a hub GGUF as `org/repo/file.gguf`.
Remote code runs only when `trust_remote_code=True` is asked for.

Precision (decided here, used by every worker):
- CPU: float32 everywhere, no autocast.
- CUDA: parameters, gradients and AdamW state stay float32 and forwards run under bf16 autocast.
  That is the numerics of FSDP2 mixed precision (bf16 compute, fp32 master weights) without a second
  copy of the weights, and the optimizer needs no loss scaling. The reference defaults to the same
  setting so its logprobs equal the policy's at step 0 (KL exactly 0); pass `param_dtype=torch.bfloat16`
  to halve its memory when that matters more.

Dropout is switched off in every model: PPO's importance ratio must be exactly 1 when the policy has
not moved, and a value model trained with dropout predicts differently from the one that is evaluated.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from trainer.config.derive import fast_bf16_cpu

log = logging.getLogger(__name__)

DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "classifier_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "dropout",
)
# Tokenizer classes that mean "use tokenizer.json exactly as written" (see load_tokenizer).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained reads: a hub id or folder, plus the GGUF file name inside it if any."""

    name_or_dir: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


@dataclass(frozen=True)
class Precision:
    """Storage dtype of trainable parameters and the autocast dtype of forwards (None = no autocast)."""

    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None


def default_precision(device: torch.device | str, mixed_precision: str = "auto") -> Precision:
    """fp32 parameters always; bf16 autocast on CUDA by default, or with `mixed_precision="bf16"` on CUDA
    and on a CPU that multiplies bf16 in hardware (elsewhere bf16 is ~70x slower: fp32, said at start)."""
    cuda = torch.device(device).type == "cuda"
    bf16 = (mixed_precision == "bf16" and (cuda or fast_bf16_cpu())) or (mixed_precision == "auto" and cuda)
    return Precision(param_dtype=torch.float32, autocast_dtype=torch.bfloat16 if bf16 else None)


def without_cudnn_attention() -> None:
    """SDPA in this process never takes cuDNN's attention (process-wide: SDPA's backend flags are global).

    cuDNN's attention, SDPA's first choice on Hopper in recent torch, builds an execution plan on the
    host for every new shape: on an H200 (torch 2.11) 55-65 ms a forward and 90-116 ms a forward and
    backward at [64, 14, ~200, 64] against 0.1-0.9 ms for flash attention, which has no per-shape setup
    (bench/prefill_attention.py). Our shapes are new nearly every call: a rollout phase's prefill, every
    padded micro-batch."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """The forward-pass autocast context for a worker (a no-op context when dtype is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


class ModelUnavailable(RuntimeError):
    """A hub model that is not in the local cache while the hub is unreachable; the message is one line."""


def _offline_kwargs(source: ModelSource) -> dict:
    """local_files_only for a hub id when the hub cannot be reached: the cache or one clear error, not
    huggingface_hub's retries (~50 s on a machine without it) and an 80-line traceback."""
    if Path(source.name_or_dir).exists():
        return {}
    from services.common.hub import hub_reachable

    return {} if hub_reachable() else {"local_files_only": True}


@contextlib.contextmanager
def _hub_errors(path: str, kwargs: dict):
    try:
        yield
    except OSError:
        if not kwargs.get("local_files_only"):
            raise
        raise ModelUnavailable(
            f"model {path}: the Hugging Face hub is unreachable and it is not in the local cache; give a "
            "local folder or .gguf file instead (actor_rollout_ref.model.path=PATH), or point HF_HOME at a "
            "cache that holds it"
        ) from None


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or Path(path).expanduser().exists()


def resolve_source(path: str) -> ModelSource:
    """Split `path` into (hub id or folder, GGUF file name); local paths must exist."""
    if not path:
        raise ValueError("model path is empty")
    local = Path(path).expanduser()
    if path.endswith(".gguf"):
        if local.is_file():
            return ModelSource(str(local.parent), local.name)
        parts = path.split("/")
        if _looks_local(path) or len(parts) < 3:
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ModelSource("/".join(parts[:2]), "/".join(parts[2:]))
    if local.exists():
        if not local.is_dir():
            raise ValueError(
                f"model path {path} is a file but not a .gguf file; give a folder, a GGUF file or a hub id"
            )
        return ModelSource(str(local))
    if _looks_local(path) or path.count("/") > 1:
        raise FileNotFoundError(
            f"model path {path} does not exist (neither a folder, a GGUF file nor a hub id)"
        )
    return ModelSource(path)


def _declared_tokenizer_class(source: ModelSource) -> str | None:
    config_file = Path(source.name_or_dir) / "tokenizer_config.json"
    if source.gguf_file or not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("tokenizer_class")


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer with its chat template, pad token falling back to eos, padding on the left.

    A folder whose tokenizer_config declares the generic fast class is loaded from tokenizer.json as
    written: transformers 5 would otherwise rebuild Qwen2 models' tokenizers with Qwen's own
    pre-tokenizer, which breaks the character tokenizer of our tiny test models.
    """
    source = resolve_source(path)
    offline = _offline_kwargs(source)
    if _declared_tokenizer_class(source) in GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source.name_or_dir)
    else:
        with _hub_errors(path, offline):
            tokenizer = AutoTokenizer.from_pretrained(
                source.name_or_dir, trust_remote_code=trust_remote_code, **source.kwargs(), **offline
            )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if not tokenizer.chat_template:
        log.warning(
            "tokenizer of %s has no chat template; prompts must be given as token ids or plain text", path
        )
    return tokenizer


def _config_without_dropout(source: ModelSource, trust_remote_code: bool, **overrides):
    offline = _offline_kwargs(source)
    with _hub_errors(source.name_or_dir, offline):
        config = AutoConfig.from_pretrained(
            source.name_or_dir, trust_remote_code=trust_remote_code, **source.kwargs(), **offline
        )
    for key in DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), (int, float)):
            setattr(config, key, 0.0)
    for key, value in overrides.items():  # set after loading: from_pretrained drops keys the config lacks
        setattr(config, key, value)
    return config


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant checkpointing works with inputs that need no grad and with autocast.
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def _load(
    auto_class,
    path: str,
    *,
    device: torch.device | str = "cpu",
    param_dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    config_overrides: dict | None = None,
) -> PreTrainedModel:
    source = resolve_source(path)
    config = _config_without_dropout(source, trust_remote_code, **(config_overrides or {}))
    offline = _offline_kwargs(source)
    with _hub_errors(path, offline):
        model = auto_class.from_pretrained(
            source.name_or_dir,
            config=config,
            dtype=param_dtype,
            trust_remote_code=trust_remote_code,
            **source.kwargs(),
            **offline,
        )
    model = model.to(device=device, dtype=param_dtype)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.train()


# Each loader takes `path` (a hub id, a folder or a .gguf file) and _load's keywords: device, param_dtype,
# trust_remote_code, gradient_checkpointing.


def load_policy(path: str, **options) -> PreTrainedModel:
    """The trainable causal LM (train mode)."""
    return _load(AutoModelForCausalLM, path, **options)


def load_reference(path: str, **options) -> PreTrainedModel:
    """The frozen reference policy: eval mode, no gradients."""
    return _load(AutoModelForCausalLM, path, **options).requires_grad_(False).eval()


def load_critic(path: str, **options) -> PreTrainedModel:
    """The value model: the causal LM's backbone with a fresh scalar head per token (as verl builds it).

    AutoModelForTokenClassification with num_labels=1 keeps the checkpoint an ordinary HF model;
    the LM head of a causal checkpoint is dropped and `score` starts from the config's init.
    """
    overrides = {"num_labels": 1, "classifier_dropout": 0.0}
    return _load(AutoModelForTokenClassification, path, config_overrides=overrides, **options)


def backbone_and_head(model: PreTrainedModel) -> tuple[nn.Module, nn.Module]:
    """(the transformer that yields hidden states, the output projection) of a causal LM or value model."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "score", None)
    backbone = model.base_model
    if head is None or backbone is model:
        raise TypeError(f"{type(model).__name__} has no separable backbone and output head")
    return backbone, head
