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
import logging
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.batch import to_device

log = logging.getLogger(__name__)

PACKED_ATTENTION = "packed_varlen"


@dataclass(frozen=True)
class Packed:
    """One micro-batch's real tokens as a single row, and where each came from."""

    input_ids: Tensor  # [1, N]
    position_ids: Tensor  # [1, N], restarting at 0 for every sequence
    cu_seq_lens: Tensor  # [B+1] int32, sequence boundaries in the packed row
    max_length: int  # the longest sequence
    offsets: Tensor  # [B+1] int64 on the host: cu_seq_lens, for planning gathers from the packed row
    # Shared prompts (`pack_shared`): each sample's keys and values are its [prompt; response] gathered
    # from the packed row (`expand`), laid end to end as `key_cu_seq_lens` says; its queries stay its
    # tokens in the packed row, the last of its keys. None: the packed row holds every key.
    expand: Tensor | None = None  # [N'] on the device
    key_cu_seq_lens: Tensor | None = None  # [B+1] int32, sequence boundaries in the expanded layout
    key_max_length: int | None = None

    def model_kwargs(self) -> dict:
        """What the model's forward takes to run packed. The attention function confines each sequence
        itself; the empty 4D `attention_mask` only makes transformers pass it through as it is instead of
        building a mask, whose packed-sequence detection reads the position ids back from the GPU (a
        sync per forward)."""
        shared = self.expand is not None
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.input_ids.new_empty((1, 1, 0, 0), dtype=torch.bool),
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.key_cu_seq_lens if shared else self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.key_max_length if shared else self.max_length,
            **({"shared_expand": self.expand} if shared else {}),
        }


def pack(input_ids: Tensor, starts: Tensor, lengths: Tensor) -> Packed:
    """Pack each row's real tokens, input_ids[b, starts[b] : starts[b] + lengths[b]], into one row.

    starts and lengths ([B] integers) are read on the host: the layout is planned on the CPU and only
    index tensors go to the device, so packing a micro-batch on a GPU never waits for the GPU (the
    boolean-mask indexing this replaced synchronised several times a micro-batch).
    """
    starts, lengths = starts.cpu().long(), lengths.cpu().long()
    if bool((lengths <= 0).any()):
        raise ValueError("cannot pack a row without real tokens")
    width = input_ids.shape[1]
    row_of, offsets, positions = segments(lengths)
    source = row_of * width + starts[row_of] + positions  # each packed token's place in input_ids.view(-1)
    device = input_ids.device
    return Packed(
        input_ids=input_ids.reshape(-1).index_select(0, to_device(source, device))[None],
        position_ids=to_device(positions, device)[None],
        cu_seq_lens=to_device(offsets.to(torch.int32), device),
        max_length=int(lengths.max()),
        offsets=offsets,
    )


def segments(lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Host [B] lengths laid end to end: each element's row and its position within the row [N], and
    the rows' offsets [B+1] (0, len_0, len_0 + len_1, ..., N)."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offsets = F.pad(torch.cumsum(lengths, dim=0), (1, 0))
    return rows, offsets, torch.arange(len(rows)) - offsets[rows]


def pack_batch(batch) -> Packed:
    """pack() of a TrainBatch: row b's real tokens start at P - prompt_length[b] (left-padded prompt)."""
    return pack(
        batch.input_ids,
        batch.prompt_width - batch.prompt_lengths.cpu(),
        batch.prompt_lengths.cpu() + batch.response_lengths.cpu(),
    )


def pack_shared(batch) -> tuple[Packed, Tensor]:
    """pack_batch() with each run of consecutive rows of one group (same group id and prompt length:
    GRPO's n samples of a prompt) packed as its prompt once, then each row's response:

        rows     p0 p1 a0 a1 | p0 p1 b0          packed     p0 p1 a0 a1 b0
        position  0  1  2  3 |  0  1  2          position    0  1  2  3  2

    The layers see every prompt token once. Attention gathers each row's keys and values of
    [prompt; response] (`Packed.expand`), and its queries are the row's tokens in the packed row (the
    whole sequence for a run's first row, the response for the others): the last of its keys, so a
    causal mask aligned to the keys' end lets each response see exactly the tokens it sees unshared.
    The gathers' backward adds every row's gradient into the one prompt. Logprobs and gradients are
    those of pack_batch (to float rounding); the layers' work on prompts drops by the group size.
    Returns (packed, predicting): the packed position predicting each real response token, in
    ResponseTokens order.

    A group id stands for one prompt (TrainBatch.group_ids); where the tokens are on the host (CPU runs)
    the prompts are compared too, and rows whose prompts differ are not shared. On a GPU that would wait
    for the device, so there the group ids are trusted. Planned on the host with array arithmetic, no
    loop over rows."""
    prompt = batch.prompt_lengths.cpu().long()
    response = batch.response_lengths.cpu().long()
    if bool(((prompt + response) <= 0).any()):
        raise ValueError("cannot pack a row without real tokens")
    rows, width, prompt_width = len(prompt), batch.input_ids.shape[1], batch.prompt_width
    same = same_group_as_previous(batch)
    if batch.input_ids.device.type == "cpu":  # left-padded to one width: equal windows, equal prompts
        windows = batch.input_ids[:, :prompt_width]
        same &= (windows[1:] == windows[:-1]).all(dim=1)
    new_run = torch.cat((torch.ones(1, dtype=torch.bool), ~same)).long()
    shown = prompt * new_run  # prompt tokens a row puts in the packed row: its run's first row's
    block = _exclusive_cumsum(shown + response)  # where each row's tokens start in the packed row
    run_first = torch.cummax(torch.where(new_run.bool(), torch.arange(rows), 0), dim=0).values
    prompt_at, response_at = block[run_first], block + shown
    row_base = torch.arange(rows) * width + prompt_width

    def laid(*pieces):  # (start, length) pairs a row, row by row: the concatenated ranges
        return _ranges(torch.stack([s for s, _ in pieces], 1), torch.stack([n for _, n in pieces], 1))

    source = laid((row_base - prompt, shown), (row_base, response))
    positions = laid((torch.zeros_like(prompt), shown), (prompt, response))
    expand = laid((prompt_at, prompt), (response_at, response))
    has = (response > 0).long()
    predicting = laid((prompt_at + prompt - 1, has), (response_at, (response - 1).clamp(min=0)))
    queries, keys = shown + response, prompt + response
    offsets = F.pad(torch.cumsum(queries, dim=0), (1, 0))
    device = batch.input_ids.device
    result = Packed(
        input_ids=batch.input_ids.reshape(-1).index_select(0, to_device(source, device))[None],
        position_ids=to_device(positions, device)[None],
        cu_seq_lens=to_device(offsets.to(torch.int32), device),
        max_length=int(queries.max()),
        offsets=offsets,
        expand=to_device(expand, device),
        key_cu_seq_lens=to_device(F.pad(torch.cumsum(keys, dim=0), (1, 0)).to(torch.int32), device),
        key_max_length=int(keys.max()),
    )
    return result, predicting


def shared_prompt_tokens(batch) -> int:
    """Prompt tokens a batch's shared-prompt forwards do not run: every row's after its run's first
    (where a micro-batch cuts a run, its next part runs the prompt again: slightly fewer; a token budget
    cuts between runs where they fit, `trainer.workers.common.budget_units`)."""
    return int(batch.prompt_lengths.cpu()[1:][same_group_as_previous(batch)].sum())


def same_group_as_previous(batch) -> Tensor:
    """[B-1] host bools: row b+1 has row b's group id and prompt length."""
    prompt, groups = batch.prompt_lengths.cpu(), batch.group_ids.cpu()
    return (groups[1:] == groups[:-1]) & (prompt[1:] == prompt[:-1])


def _exclusive_cumsum(values: Tensor) -> Tensor:
    return torch.cumsum(values, dim=0) - values


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """[start, start + length) for every (start, length) in row-major order, concatenated."""
    starts, lengths = starts.reshape(-1), lengths.reshape(-1)
    return torch.repeat_interleave(starts - _exclusive_cumsum(lengths), lengths) + torch.arange(
        int(lengths.sum())
    )


def mask_spans(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(starts, lengths) of contiguous real tokens from a host attention mask [B, L], for pack()."""
    mask = attention_mask.cpu().bool()
    return mask.int().argmax(dim=1), mask.sum(dim=1)


# ------------------------------------------------------------------------------ the attention function


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, packed: dict, scale: float) -> Tensor:
    """Causal attention within each packed sequence. query [N, H, D], key/value [N, H_kv, D] -> [N, H, D].

    With shared prompts (`pack_shared`) the keys and values are gathered into every sequence's
    [prompt; response] (`shared_expand`); a sequence's queries are the last of its keys, and the causal
    mask is aligned to the keys' end (as flash attention aligns it)."""
    kernel = _cuda_varlen_kernel() if query.is_cuda else None
    dtype = flash_dtype(query, key, value, cuda_autocast_dtype()) if kernel is not None else None
    query, key, value = _operands(query, key, value, packed, dtype)
    if dtype is not None:
        try:
            return kernel(query, key, value, packed, scale)
        except torch.OutOfMemoryError:  # a RuntimeError, but this micro-batch's, not the kernel's fault
            raise
        except (RuntimeError, TypeError, ValueError) as exc:  # an older or newer torch's signature
            log.warning("flash attention failed (%s): packed attention runs per sequence from now on", exc)
            _cuda_varlen_kernel.cache_clear()
            _DISABLED.add("varlen")
    return _attention_per_sequence(query, key, value, packed["cu_seq_lens_q"], packed["cu_seq_lens_k"], scale)


def _operands(query: Tensor, key: Tensor, value: Tensor, packed: dict, dtype: torch.dtype | None):
    """q, k, v cast to flash attention's `dtype` (None: kept), then (shared prompts) the keys and values
    gathered into each sequence's [prompt; response]: cast first, the gathers move half the bytes."""
    if dtype is not None:
        query, key, value = (t.to(dtype) for t in (query, key, value))
    expand = packed.get("shared_expand")
    if expand is not None:
        key, value = key.index_select(0, expand), value.index_select(0, expand)
    return query, key, value


def _flash(query: Tensor, key: Tensor, value: Tensor, packed: dict, scale: float) -> Tensor:
    """aten's variable-length flash attention, causal; with fewer queries than keys its mask ends at the
    keys' end (flash-attention >= 2.1). Arguments: q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p,
    is_causal, return_debug_mask."""
    return torch.ops.aten._flash_attention_forward(
        query,
        key,
        value,
        packed["cu_seq_lens_q"],
        packed["cu_seq_lens_k"],
        packed["max_length_q"],
        packed["max_length_k"],
        0.0,
        True,
        False,
        scale=scale,
    )[0]


_DISABLED: set[str] = set()
HALF = (torch.float16, torch.bfloat16)
_HAS_FLASH = hasattr(torch.ops.aten, "_flash_attention_forward")


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


def _attention_per_sequence(query: Tensor, key: Tensor, value: Tensor, queries: Tensor, keys: Tensor, scale):
    """Exact causal SDPA a sequence: its n queries are the last n of its keys (mask aligned to the end)."""
    parts = []
    for (q0, q1), (k0, k1) in zip(_bounds(queries), _bounds(keys)):
        q, k, v = (
            t[start:end].transpose(0, 1)[None]
            for t, start, end in ((query, q0, q1), (key, k0, k1), (value, k0, k1))
        )
        past = (k1 - k0) - (q1 - q0)  # keys before the first query: all visible
        mask = (
            None if past == 0 else torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(past)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


def _bounds(cu_seq_lens: Tensor) -> list[tuple[int, int]]:
    bounds = cu_seq_lens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


@functools.cache
def _cuda_varlen_kernel():
    """Flash attention over the packed sequences (aten's variable-length kernel, with its own backward);
    None if this torch has none. It takes fewer key/value heads than query heads as they are (GQA):
    torch's `varlen_attn` wrapper before 2.13 refused them, and repeating K and V to every head cost a
    0.5B update ~16 ms forward and ~9 ms of backward reduction (a profile on an H200)."""
    if "varlen" in _DISABLED:
        return None
    if not _HAS_FLASH:
        log.warning(
            "torch has no variable-length flash attention: packed attention runs per sequence (slower)"
        )
        return None
    return _flash


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


def use_packed_attention(model, *, token_major: bool = True, share_prompts: bool = False) -> None:
    """Switch a loaded model (all its sub-configs) to the packed attention implementation, and (unless
    `token_major` is off: benchmarks compare) give its attention modules the token-major packed forward
    (`token_major_attention`) where their layout allows. share_prompts: its forwards share each group's
    prompt (`pack_shared`)."""
    model.share_prompts = share_prompts  # a module attribute, not the config: checkpoints do not carry it
    name = register_packed_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name
    for module in model.modules():
        if token_major and _token_major_capable(module):
            module.forward = types.MethodType(token_major_attention, module)


# ------------------------------------------------------------------------------ token-major attention
#
# Hugging Face attention modules turn the projections into head-major [1, H, N, D] views before the
# rotary embedding, which writes q and k head-major. The packed kernel wants token-major [N, H, D], and
# in the compiled decoder layers the attention call is a graph break: the compiled half before it returns
# q, k, v head-major, and its backward is handed the gradients coerced to that layout. With bf16
# parameters that cost transposing copies and a slow fused copy + bias-gradient reduction per layer
# (0.6-2.2 ms of a layer's backward on H100s; BENCHMARKS.md). Packed forwards keep everything token-major
# instead: the projections' [N, H*D] rows are viewed as [N, H, D], rotated in place of the layout, and
# handed to the kernel as they are, so neither direction transposes. Other calls (a KV cache, a padded
# batch, the rollout's decoding) take the module's own forward.

_TOKEN_MAJOR_TYPES = ("Qwen2Attention", "LlamaAttention", "Qwen3Attention")
_CACHE_KEYS = ("past_key_values", "past_key_value", "cache")


def _token_major_capable(module) -> bool:
    """Attention modules whose forward is exactly: q/k/v projections (optionally per-head q/k norms),
    half-split rotary embedding on all of head_dim, attention, o projection."""
    return type(module).__name__ in _TOKEN_MAJOR_TYPES and all(
        hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    )


def rotate_token_major(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The half-split rotary embedding (Llama / Qwen) of x [N, H, D]; cos, sin [1, N, D]."""
    cos, sin = cos[0, :, None], sin[0, :, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class _AddBias(torch.autograd.Function):
    """y + bias, whose bias gradient (the sum of the output gradient over tokens) is a matmul with a row
    of ones. In compiled backward graphs that sum became a Triton reduction over ~24k packed tokens into
    128 outputs (a key / value projection's bias), which the compiler did not split across the GPU:
    ~0.6 ms a layer on an H100 where cuBLAS takes microseconds."""

    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor) -> Tensor:
        return y + bias

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows = grad.reshape(-1, grad.shape[-1])
        return grad, (rows.new_ones(1, rows.shape[0]) @ rows).view(-1)


def project(linear, x: Tensor) -> Tensor:
    """linear(x) for an nn.Linear, its bias added by `_AddBias`; other modules (adapters) are called."""
    if type(linear) is not torch.nn.Linear or linear.bias is None:
        return linear(x)
    y = F.linear(x, linear.weight)
    return _AddBias.apply(y, linear.bias.to(y.dtype))


def token_major_attention(
    self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, **kwargs
):
    """A packed forward of a Llama / Qwen attention module in the token-major layout; the module's
    own forward for anything else."""
    cached = any(kwargs.get(key) is not None for key in _CACHE_KEYS)
    if (
        kwargs.get("cu_seq_lens_q") is None
        or cached
        or position_embeddings is None
        or hidden_states.shape[0] != 1
        or getattr(self, "sliding_window", None) is not None
    ):
        return type(self).forward(
            self,
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
    tokens = hidden_states.shape[1]
    shape = (tokens, -1, self.head_dim)  # [N, H, D]: views of the projections' rows, no copies
    query = project(self.q_proj, hidden_states).view(shape)
    key = project(self.k_proj, hidden_states).view(shape)
    value = project(self.v_proj, hidden_states).view(shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
        query, key = self.q_norm(query), self.k_norm(key)
    cos, sin = position_embeddings
    query, key = rotate_token_major(query, cos, sin), rotate_token_major(key, cos, sin)
    out = _packed_kernel_call(query, key, value, kwargs, self.scaling)  # [N, H, D]
    return self.o_proj(out.view(1, tokens, -1)), None


def _packed_kernel_call(query: Tensor, key: Tensor, value: Tensor, packed: dict, scale: float) -> Tensor:
    """varlen_causal_attention, for the token-major forward. In a compiled decoder layer on CUDA the flash
    kernel is traced into the layer's graph (torch gives it a fake and a backward), so the layer is one
    compiled region; called eagerly (`torch.compiler.disable`) it splits the layer into two, and each
    region's entry and autograd wrappers cost host time: ~160 ms of a 2.6 s one-H200 step for 768 region
    entries (BENCHMARKS.md). The per-sequence fallback reads the sequence bounds on the host: eager."""
    if torch.compiler.is_compiling() and query.is_cuda and _HAS_FLASH and "varlen" not in _DISABLED:
        dtype = flash_dtype(query, key, value, cuda_autocast_dtype())
        if dtype is not None:
            return _flash(*_operands(query, key, value, packed, dtype), packed, scale)
    return _eager_varlen(query, key, value, packed, scale)


_eager_varlen = torch.compiler.disable(varlen_causal_attention)  # a graph break in compiled layers


def is_packed(model) -> bool:
    """Whether `use_packed_attention` set this model up for padding-free forwards."""
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION


def shares_prompts(model) -> bool:
    """Whether its packed forwards share each group's prompt (`use_packed_attention(share_prompts=...)`)."""
    return is_packed(model) and getattr(model, "share_prompts", False)


# ------------------------------------------------------------------------------ hidden states of responses


@dataclass(frozen=True)
class ResponseTokens:
    """Where a batch's real response tokens sit in its response-aligned [B, T] layout (row-major order),
    planned on the host from the response lengths: gathers and scatters by index, never by a boolean
    mask (which would wait for the device to count it)."""

    shape: tuple[int, int]  # (B, T)
    rows: Tensor  # [N] host: each token's row
    columns: Tensor  # [N] host: its column t < response_lengths[row]
    flat: Tensor  # [N] rows * T + columns, on the batch's device

    @classmethod
    def of(cls, batch) -> ResponseTokens:
        rows, _, columns = segments(batch.response_lengths.cpu().long())
        shape = (len(batch), batch.response_width)
        return cls(shape, rows, columns, to_device(rows * shape[1] + columns, batch.input_ids.device))

    def take(self, values: Tensor) -> Tensor:
        """[B, T] -> [N]: the values at the real response tokens."""
        return values.reshape(-1).index_select(0, self.flat)

    def place(self, values: Tensor) -> Tensor:
        """[N] -> [B, T]: the values at the real response tokens, 0 elsewhere (differentiable)."""
        zeros = values.new_zeros(self.shape[0] * self.shape[1])
        return zeros.index_copy(0, self.flat, values).view(self.shape)


def response_hidden_states(
    backbone, batch, *, remove_padding: bool, share_prompts: bool = False
) -> tuple[Tensor, ResponseTokens]:
    """Hidden states [N_resp, H] at the positions that predict the batch's real response tokens, and
    where those tokens are (`ResponseTokens`, in the same order).

    Position P-1+t predicts response token t; packed, row b's position P-1+t is its packed position
    offsets[b] + prompt_length[b] - 1 + t (the backbone sees only real tokens). share_prompts (packed
    only): a group's rows share one forward of their prompt (`pack_shared`).
    """
    tokens = ResponseTokens.of(batch)
    prompt_lengths = batch.prompt_lengths.cpu().long()
    if bool((prompt_lengths[tokens.rows] < 1).any()):
        raise ValueError("a response needs a prompt of at least one token to be predicted from")
    device = batch.input_ids.device
    if remove_padding and share_prompts:
        packed, predicting = pack_shared(batch)
        hidden = backbone(**packed.model_kwargs(), use_cache=False).last_hidden_state[0]
        return hidden.index_select(0, to_device(predicting, device)), tokens
    if remove_padding:
        packed = pack_batch(batch)
        hidden = backbone(**packed.model_kwargs(), use_cache=False).last_hidden_state[0]
        predicting = packed.offsets[tokens.rows] + prompt_lengths[tokens.rows] - 1 + tokens.columns
        return hidden.index_select(0, to_device(predicting, device)), tokens
    attention_mask = batch.attention_mask
    if getattr(backbone.config, "_attn_implementation", None) == "sdpa":
        attention_mask = padded_causal_mask(attention_mask)
    hidden = backbone(
        input_ids=batch.input_ids,
        attention_mask=attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    prompt_width, (rows, width) = batch.prompt_width, tokens.shape
    predicting = hidden[:, prompt_width - 1 : prompt_width - 1 + width].reshape(rows * width, -1)
    return predicting.index_select(0, tokens.flat), tokens


def padded_causal_mask(attention_mask: Tensor) -> Tensor:
    """[B, L] padding mask -> [B, 1, L, L] boolean SDPA mask (True: attend): causal over real keys.

    Built here, on the device, because transformers' own builder checks whether the mask can be skipped
    by reading it back from the GPU (two syncs a forward). A padding query sees only itself, which keeps
    its row finite (a row with nothing to attend to is NaN in SDPA, and NaN reaches the weight
    gradients even though the loss never reads the row); real tokens see exactly what they see in the
    mask transformers builds.
    """
    length = attention_mask.shape[1]
    device = attention_mask.device
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=device)
    return ((causal & attention_mask.bool()[:, None, :]) | itself)[:, None]
