"""Padding removal (verl's `use_remove_padding=True`): a micro-batch's sequences packed into one row.

A padded micro-batch [B, L] spends compute on every pad token. Packed, its real tokens become one row
[1, N] (N = the real token count), position ids restart at 0 for each sequence, and attention is
confined to each sequence by cumulative lengths `cu_seq_lens` = [0, len_0, len_0 + len_1, ..., N]:

    padded   p p a0 a1 a2 | b0 b1 . .            packed   a0 a1 a2 b0 b1 ...
    position 0 0  0  1  2 |  0  1 1 1            position  0  1  2  0  1 ...
                                                 cu_seq_lens [0, 3, 5, ...]

The forward pass goes through a Hugging Face model unchanged: `packed_attention` is registered as an
attention implementation (`PACKED_ATTENTION`) and receives `cu_seq_lens_q` / `max_length_q` from the
model's keyword arguments, which transformers hands down to every attention call. On CUDA it runs
PyTorch's variable-length flash attention; elsewhere (CPU tests) it runs causal SDPA per sequence,
which is exact. Without those keyword arguments (a padded batch, or the rollout engine decoding with a
KV cache on the same module) it is plain SDPA, so the same model serves both.

Every real token sees exactly the tokens it sees in the padded layout, with the same positions, so
logprobs and values are those of the padded forward (to float rounding): tests check it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

PACKED_ATTENTION = "packed_varlen"


@dataclass(frozen=True)
class Packed:
    """One micro-batch's real tokens as a single row, and where each came from."""

    input_ids: Tensor  # [1, N]
    position_ids: Tensor  # [1, N], restarting at 0 for every sequence
    cu_seq_lens: Tensor  # [B+1] int32, sequence boundaries in the packed row
    max_length: int  # the longest sequence
    index: Tensor  # [B, L] the packed position of each real token of the padded layout, -1 on padding

    def model_kwargs(self) -> dict:
        """What the model's forward takes to run packed."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """Pack rows whose real tokens are contiguous (left-padded prompt, right-padded response)."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("cannot pack a row without real tokens")
    total = int(lengths.sum())
    index = torch.full_like(input_ids, -1)
    index[real] = torch.arange(total, device=input_ids.device)
    starts = torch.cumsum(lengths, dim=0) - lengths
    positions = torch.arange(total, device=input_ids.device) - torch.repeat_interleave(starts, lengths)
    cu_seq_lens = F.pad(torch.cumsum(lengths, dim=0), (1, 0)).to(torch.int32)
    return Packed(
        input_ids=input_ids[real][None],
        position_ids=positions[None],
        cu_seq_lens=cu_seq_lens,
        max_length=int(lengths.max()),
        index=index,
    )


# ------------------------------------------------------------------------------ the attention function


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, packed: dict, scale: float) -> Tensor:
    """Causal attention within each packed sequence. query [N, H, D], key/value [N, H_kv, D] -> [N, H, D]."""
    if query.is_cuda:
        kernel = _cuda_varlen_kernel()
        dtype = flash_dtype(query, key, value, cuda_autocast_dtype())
        if kernel is not None and dtype is not None:
            query, key, value = (t.to(dtype) for t in (query, key, value))
            try:
                return kernel(query, key, value, packed["cu_seq_lens_q"], packed["max_length_q"], scale)
            except (RuntimeError, TypeError, ValueError) as exc:  # an older or newer torch's signature
                log.warning("varlen_attn failed (%s): packed attention runs per sequence from now on", exc)
                _cuda_varlen_kernel.cache_clear()
                _DISABLED.add("varlen")
    return _attention_per_sequence(query, key, value, packed["cu_seq_lens_q"], scale)


_DISABLED: set[str] = set()
HALF = (torch.float16, torch.bfloat16)


def flash_dtype(query: Tensor, key: Tensor, value: Tensor, autocast_dtype: torch.dtype | None):
    """The half dtype flash attention should run in, or None (then: exact attention per sequence).

    Under autocast the projections come out in half precision but the rotary embedding multiplies q and
    k by fp32 cos/sin, so they arrive in fp32 next to a half v. Flash attention takes half only, and
    autocast would run SDPA (the padded path) in its half dtype too: cast all three to it. A run in
    full precision without autocast keeps fp32 attention.
    """
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) == 1 and dtypes <= set(HALF):
        return query.dtype
    return autocast_dtype if autocast_dtype in HALF else None


def cuda_autocast_dtype() -> torch.dtype | None:
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _attention_per_sequence(query: Tensor, key: Tensor, value: Tensor, cu_seq_lens: Tensor, scale: float):
    bounds = cu_seq_lens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # [1, H, n, D]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


@functools.cache
def _cuda_varlen_kernel():
    """PyTorch's variable-length flash attention (torch >= 2.9), adapted to its signature; None if absent."""
    if "varlen" in _DISABLED:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.warning("torch has no varlen_attn: packed attention runs per sequence (slower)")
        return None
    parameters = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    native_gqa = "enable_gqa" in parameters

    def kernel(query, key, value, cu_seq_lens, max_length, scale):
        extra = dict(causal)
        if key.shape[1] != query.shape[1]:
            if native_gqa:
                extra["enable_gqa"] = True
            else:
                groups = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return varlen_attn(
            query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale, **extra
        )

    return kernel


def packed_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    **kwargs,
):
    """transformers' attention-function signature: query [1, H, N, D] -> ([1, N, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("cu_seq_lens_q") is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"a packed forward takes one row, got a batch of {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    return varlen_causal_attention(q, k, v, kwargs, scale)[None], None


def packed_mask(*args, **kwargs):
    """No mask when running packed (or unpadded): the attention function confines each sequence itself."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_packed_attention() -> str:
    """Make `PACKED_ATTENTION` a transformers attention implementation; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # torch.compile'd decoder layers (trainer/compiling.py) call it eagerly: one graph break per layer
    AttentionInterface.register(PACKED_ATTENTION, torch.compiler.disable(packed_attention))
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
    return PACKED_ATTENTION


def use_packed_attention(model) -> None:
    """Switch a loaded model (all its sub-configs) to the packed attention implementation."""
    name = register_packed_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name


def is_packed(model) -> bool:
    """Whether `use_packed_attention` set this model up for padding-free forwards."""
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION


# ------------------------------------------------------------------------------ hidden states of responses


def response_hidden_states(backbone, batch, *, remove_padding: bool) -> tuple[Tensor, Tensor]:
    """Hidden states [N_resp, H] at the positions that predict the batch's real response tokens, and the
    [B, T] mask of those tokens (their order: row-major over the mask).

    Position P-1+t predicts response token t. Packed: the backbone sees only real tokens.
    """
    prompt_width, response_width = batch.prompt_width, batch.response_width
    real = batch.attention_mask[:, prompt_width:].bool()
    if remove_padding:
        packed = pack(batch.input_ids, batch.attention_mask)
        hidden = backbone(**packed.model_kwargs(), use_cache=False).last_hidden_state[0]
        predicting = packed.index[:, prompt_width - 1 : prompt_width - 1 + response_width][real]
        return hidden[predicting], real
    hidden = backbone(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    return hidden[:, prompt_width - 1 : prompt_width - 1 + response_width][real], real
