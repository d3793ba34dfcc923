"""The built-in engine's own forward pass for Qwen2 / Qwen3 / Llama-shaped decoders.

Why not run the transformers module: the engine needs (1) fused weights (one QKV and one gate-up matmul
per layer), (2) a KV cache it owns and indexes by slot, written in place, and (3) a decode step whose
tensors never change address, so that it can be captured once as a CUDA graph per batch-size bucket.
The math follows transformers' Qwen2/Llama modelling code step for step (RMSNorm in fp32 then cast,
rotate-half RoPE with fp32 angles, SwiGLU), so greedy decoding in fp32 reproduces `model.generate`.

Shapes: B sequences, T prompt tokens, H hidden, Hq / Hkv query / key-value heads of D dims, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.model import without_cudnn_attention

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# Prefixes that wrappers add to parameter names (torch.compile, DDP); stripped before loading.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before RoPE
    tied_embeddings: bool
    max_positions: int

    @property
    def group(self) -> int:
        """Query heads per key-value head (GQA)."""
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """A transformers config -> shape; ValueError naming what the engine cannot run."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the built-in engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}"
            )
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"the built-in engine supports default RoPE only, not rope_type={rope_type!r}")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("the built-in engine does not implement sliding-window attention")
        if getattr(config, "mlp_bias", False):
            raise ValueError("the built-in engine does not implement MLP biases")
        heads = config.num_attention_heads
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            rms_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=config.max_position_embeddings,
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# attend(q [B, Hq, D], k_cache [S, Hkv, Tmax, D], v_cache, slots [B], lengths [B]) -> [B, Hq, D]
DecodeAttention = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class KVCache:
    """Preallocated keys and values: [layers, slots + 1, Hkv, context, D] each.

    A sequence owns one slot for its whole life; its token at position p lives at [:, slot, :, p].
    The extra last slot is scratch for the padding rows of a CUDA-graph bucket. Zero-filled, so a
    masked read of a position nobody wrote is never NaN.
    """

    def __init__(self, shape: ModelShape, slots: int, context: int, dtype: torch.dtype, device) -> None:
        size = (shape.layers, slots + 1, shape.kv_heads, context, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.slots = slots
        self.context = context

    @property
    def padding_slot(self) -> int:
        return self.slots

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_prefix(self, src: Tensor, dst: Tensor, length: int) -> None:
        """Give slots `dst` the first `length` positions of slots `src` (n samples share one prefill)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class EngineModel:
    """Fused weights and the prefill / decode forward passes (no autograd, no nn.Module)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        if self.device.type == "cuda":  # the prefill's SDPA: 92 ms of host time a phase with cuDNN's
            without_cudnn_attention()
        s = shape
        q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def empty(*size):
            return torch.empty(size, dtype=dtype, device=self.device)

        self.embed = empty(s.vocab, s.hidden)
        self.lm_head = self.embed if s.tied_embeddings else empty(s.vocab, s.hidden)
        self.final_norm = empty(s.hidden)
        self.in_norm = [empty(s.hidden) for _ in range(s.layers)]
        self.post_norm = [empty(s.hidden) for _ in range(s.layers)]
        self.qkv_w = [empty(q_out + 2 * kv_out, s.hidden) for _ in range(s.layers)]
        self.qkv_b = [empty(q_out + 2 * kv_out) for _ in range(s.layers)] if s.qkv_bias else None
        self.q_norm = [empty(s.head_dim) for _ in range(s.layers)] if s.qk_norm else None
        self.k_norm = [empty(s.head_dim) for _ in range(s.layers)] if s.qk_norm else None
        self.o_w = [empty(s.hidden, q_out) for _ in range(s.layers)]
        self.gate_up_w = [empty(2 * s.intermediate, s.hidden) for _ in range(s.layers)]
        self.down_w = [empty(s.hidden, s.intermediate) for _ in range(s.layers)]
        # RoPE angles in fp32 for every position, as transformers computes them (inv_freq * position).
        inv_freq = 1.0 / (
            s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim)
        )
        angles = torch.arange(s.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1).to(self.device)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self._targets = self._hf_targets()

    # ------------------------------------------------------------------------------------ weights

    def _hf_targets(self) -> dict[str, Tensor]:
        """transformers parameter name -> the view of our (fused) tensor it fills."""
        s = self.shape
        q_out, kv_out, inter = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
        targets = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        targets["lm_head.weight"] = self.lm_head
        for i in range(s.layers):
            p = f"model.layers.{i}."
            qkv = self.qkv_w[i]
            targets |= {
                p + "input_layernorm.weight": self.in_norm[i],
                p + "post_attention_layernorm.weight": self.post_norm[i],
                p + "self_attn.q_proj.weight": qkv[:q_out],
                p + "self_attn.k_proj.weight": qkv[q_out : q_out + kv_out],
                p + "self_attn.v_proj.weight": qkv[q_out + kv_out :],
                p + "self_attn.o_proj.weight": self.o_w[i],
                p + "mlp.gate_proj.weight": self.gate_up_w[i][:inter],
                p + "mlp.up_proj.weight": self.gate_up_w[i][inter:],
                p + "mlp.down_proj.weight": self.down_w[i],
            }
            if self.qkv_b is not None:
                bias = self.qkv_b[i]
                targets |= {
                    p + "self_attn.q_proj.bias": bias[:q_out],
                    p + "self_attn.k_proj.bias": bias[q_out : q_out + kv_out],
                    p + "self_attn.v_proj.bias": bias[q_out + kv_out :],
                }
            if self.q_norm is not None:
                targets[p + "self_attn.q_norm.weight"] = self.q_norm[i]
                targets[p + "self_attn.k_norm.weight"] = self.k_norm[i]
        return targets

    @torch.no_grad()
    def load(self, state: Mapping[str, Tensor], *, strict: bool = True) -> int:
        """Copy (and cast) transformers-named tensors in place; returns how many were loaded.

        In place, so CUDA graphs captured over these tensors stay valid. strict: every weight of the
        model must be given (a full checkpoint); otherwise a subset may be (a partial update).
        """
        loaded, unknown = set(), []
        for raw_name, value in state.items():
            name = raw_name
            for prefix in WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            target = self._targets.get(name)
            if target is None:
                if not name.endswith("rotary_emb.inv_freq"):
                    unknown.append(raw_name)
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{raw_name}: shape {tuple(value.shape)}, the model has {tuple(target.shape)}"
                )
            target.copy_(value.detach().to(device=target.device, dtype=target.dtype))
            loaded.add(name)
        if unknown:
            raise ValueError(f"unknown weights (not a {self.shape} model?): {sorted(unknown)[:5]}")
        missing = set(self._targets) - loaded
        if self.shape.tied_embeddings:
            missing.discard("lm_head.weight")  # tied: filled by the embedding
        if strict and missing:
            raise ValueError(f"{len(missing)} weights missing, e.g. {sorted(missing)[:5]}")
        return len(loaded)

    def tensors(self) -> list[Tensor]:
        """Every weight tensor once (the tied head is the embedding)."""
        found = [self.embed, self.final_norm, *self.in_norm, *self.post_norm, *self.qkv_w, *self.o_w]
        found += [*self.gate_up_w, *self.down_w]
        found += [t for group in (self.qkv_b, self.q_norm, self.k_norm) if group for t in group]
        if not self.shape.tied_embeddings:
            found.append(self.lm_head)
        return found

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def move_to(self, device: torch.device, *, pin: bool = False) -> None:
        """Move every weight to `device`, keeping the tensor objects; pin: page-locked host copy."""
        for tensor in [*self.tensors(), self.cos, self.sin]:
            moved = tensor.data.to(device)
            tensor.data = moved.pin_memory() if pin else moved
        self.device = torch.device(device)
        self._targets = self._hf_targets()  # the fused views point at the old storage

    # ------------------------------------------------------------------------------------ forward

    def _qkv(self, h: Tensor, i: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h [..., H] -> q [..., Hq, D], k and v [..., Hkv, D], RoPE applied (cos/sin [..., D])."""
        s = self.shape
        qkv = F.linear(h, self.qkv_w[i], self.qkv_b[i] if self.qkv_b is not None else None)
        q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
        q = qkv[..., :q_out].unflatten(-1, (s.heads, s.head_dim))
        k = qkv[..., q_out : q_out + kv_out].unflatten(-1, (s.kv_heads, s.head_dim))
        v = qkv[..., q_out + kv_out :].unflatten(-1, (s.kv_heads, s.head_dim))
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm[i], s.rms_eps), rms_norm(k, self.k_norm[i], s.rms_eps)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def _mlp(self, h: Tensor, i: int) -> Tensor:
        gate, up = F.linear(h, self.gate_up_w[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_w[i])

    def _logits(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        x = rms_norm(x, self.final_norm, self.shape.rms_eps)
        if out is None:
            return F.linear(x, self.lm_head)
        return torch.mm(x, self.lm_head.t(), out=out)

    @torch.no_grad()
    def prefill(self, tokens: Tensor, lengths: Tensor, slots: Tensor, cache: KVCache) -> Tensor:
        """Right-padded prompts tokens [B, T] (lengths [B]) -> next-token logits [B, V].

        Fills positions [0, T) of each row's slot (the padding beyond a row's length too; it is never
        read, only overwritten). With right padding a causal mask alone is exact for every real token.
        """
        x = self._hidden(tokens, cache, slots)
        last = x[torch.arange(tokens.shape[0], device=x.device), lengths - 1]
        return self._logits(last)

    @torch.no_grad()
    def prompt_logits(self, tokens: Tensor) -> Tensor:
        """Tokens [T] -> the logits after every position [T, V], touching no KV cache (SGLang's input
        logprobs and prefill-only requests, both rare: no slot is taken for them)."""
        return self._logits(self._hidden(tokens[None], None, None)[0])

    def _hidden(self, tokens: Tensor, cache: KVCache | None, slots: Tensor | None) -> Tensor:
        """The last layer's hidden states [B, T, H] of right-padded prompts; fills the cache's slots."""
        s = self.shape
        width = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[:width], self.sin[:width]
        for i in range(s.layers):
            q, k, v = self._qkv(rms_norm(x, self.in_norm[i], s.rms_eps), i, cos, sin)  # [B, T, heads, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
            if cache is not None:
                cache.k[i, slots, :, :width] = k
                cache.v[i, slots, :, :width] = v
            if s.group > 1:
                k, v = k.repeat_interleave(s.group, dim=1), v.repeat_interleave(s.group, dim=1)
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
            x = x + F.linear(attended.transpose(1, 2).flatten(2), self.o_w[i])
            x = x + self._mlp(rms_norm(x, self.post_norm[i], s.rms_eps), i)
        return x

    @torch.no_grad()
    def prefill_fused(self, tokens: Tensor, lengths: Tensor, slots: Tensor, cache: KVCache) -> Tensor:
        """prefill() with decode_fused's kernels over the B x T prompt tokens as rows (GPU, Triton): RoPE
        writes each token's k and v straight into its slot, and attention reads the prompt back from the
        cache. The elementwise work of a long prefill is memory-bound: fusing it cuts its memory traffic."""
        from trainer.rollout.builtin import kernels

        s = self.shape
        batch, width = tokens.shape
        positions = torch.arange(width, device=tokens.device).repeat(batch)
        row_slots, row_lengths = slots.repeat_interleave(width), positions + 1
        x = F.embedding(tokens.reshape(-1), self.embed)  # [B*T, H], the residual stream
        h = kernels.add_rms_norm(x, self.in_norm[0], s.rms_eps)
        for i in range(s.layers):
            qkv = F.linear(h, self.qkv_w[i], self.qkv_b[i] if self.qkv_b is not None else None)
            q = kernels.rope_and_cache(
                qkv, self.cos, self.sin, row_slots, row_lengths, cache.k[i], cache.v[i], s.heads, s.kv_heads
            )
            k, v = cache.k[i, slots, :, :width], cache.v[i, slots, :, :width]  # [B, Hkv, T, D]
            if s.group > 1:
                k, v = k.repeat_interleave(s.group, dim=1), v.repeat_interleave(s.group, dim=1)
            q = q.view(batch, width, s.heads, s.head_dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            h = kernels.add_rms_norm(
                F.linear(attended.reshape(batch * width, -1), self.o_w[i]), self.post_norm[i], s.rms_eps, x
            )
            mlp = F.linear(kernels.silu_mul(F.linear(h, self.gate_up_w[i])), self.down_w[i])
            next_norm = self.in_norm[i + 1] if i + 1 < s.layers else self.final_norm
            h = kernels.add_rms_norm(mlp, next_norm, s.rms_eps, x)
        last = h.view(batch, width, -1)[torch.arange(batch, device=h.device), lengths - 1]
        return F.linear(last, self.lm_head)

    @torch.no_grad()
    def decode(
        self,
        tokens: Tensor,
        slots: Tensor,
        lengths: Tensor,
        cache: KVCache,
        attend: DecodeAttention,
        out: Tensor,
    ) -> Tensor:
        """One new token per sequence: tokens [B] at position lengths-1 of slots [B] -> logits [B, V].

        Every tensor here keeps its address from call to call (given fixed input buffers and `out`),
        which is what CUDA-graph capture needs.
        """
        s = self.shape
        positions = lengths - 1
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        for i in range(s.layers):
            q, k, v = self._qkv(rms_norm(x, self.in_norm[i], s.rms_eps), i, cos, sin)  # [B, heads, D]
            cache.k[i, slots, :, positions] = k
            cache.v[i, slots, :, positions] = v
            attended = attend(q, cache.k[i], cache.v[i], slots, lengths)
            x = x + F.linear(attended.flatten(1), self.o_w[i])
            x = x + self._mlp(rms_norm(x, self.post_norm[i], s.rms_eps), i)
        return self._logits(x, out)

    @property
    def can_fuse(self) -> bool:
        """The fused decode path covers Qwen2 / Llama (Qwen3's per-head q/k norm is not in its kernel)."""
        return not self.shape.qk_norm

    @torch.no_grad()
    def decode_fused(
        self, tokens: Tensor, slots: Tensor, lengths: Tensor, cache: KVCache, out: Tensor
    ) -> Tensor:
        """decode() in 9 kernels per layer (GPU, Triton): the residual add rides in the next RMSNorm,
        RoPE and the KV-cache write are one kernel, SiLU-and-multiply another. Between kernels the math and
        its roundings are transformers' (each fused kernel computes in fp32 and rounds once)."""
        from trainer.rollout.builtin import kernels

        s = self.shape
        x = F.embedding(tokens, self.embed)  # the residual stream, updated in place by add_rms_norm
        h = kernels.add_rms_norm(x, self.in_norm[0], s.rms_eps)
        for i in range(s.layers):
            qkv = F.linear(h, self.qkv_w[i], self.qkv_b[i] if self.qkv_b is not None else None)
            q = kernels.rope_and_cache(
                qkv, self.cos, self.sin, slots, lengths, cache.k[i], cache.v[i], s.heads, s.kv_heads
            )
            attended = kernels.decode_attention(q, cache.k[i], cache.v[i], slots, lengths)
            h = kernels.add_rms_norm(
                F.linear(attended.flatten(1), self.o_w[i]), self.post_norm[i], s.rms_eps, x
            )
            mlp = F.linear(kernels.silu_mul(F.linear(h, self.gate_up_w[i])), self.down_w[i])
            next_norm = self.in_norm[i + 1] if i + 1 < s.layers else self.final_norm
            h = kernels.add_rms_norm(mlp, next_norm, s.rms_eps, x)
        return torch.mm(h, self.lm_head.t(), out=out)


def torch_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor
) -> Tensor:
    """The plain path (CPU, or GPU without Triton): gather each slot up to the batch's longest length.

    It reads `max(lengths)` positions of every slot and masks the tail; the Triton kernel reads each
    sequence's own length only. Needs the host to know max(lengths), so it is never graph-captured.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    longest = int(lengths.max())
    k = k_cache[slots, :, :longest]  # [B, Hkv, L, D]
    v = v_cache[slots, :, :longest]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    visible = torch.arange(longest, device=q.device)[None, :] < lengths[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :])
    return out[:, :, 0]
