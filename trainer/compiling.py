"""torch.compile for the training passes of small models, with a way back to eager.

At hidden sizes of 1-2k (Qwen2.5-0.5B / 1.5B) a Hugging Face decoder layer is dozens of small kernels
(RMSNorm's fp32 upcast, RoPE, SiLU, residual adds) around a few matmuls, and the elementwise kernels
take as long as the matmuls. Compiling fuses them. Two things are compiled:

- each decoder layer's `forward` (`compile_decoder_layers`): one compiled function shared by every
  layer. Only the token dimension is symbolic from the start (marked before every call: a packed
  micro-batch has a different token count every time), the sequence count and the longest sequence
  after the first real micro-batch (one recompile, torch.compile's automatic dynamic shapes); the hidden
  and intermediate sizes stay constants. With every size symbolic (`dynamic=True`, until 2026-11-29) the
  SiLU-and-multiply kernel ran at 3.0 TB/s on an H200 against 4.3 TB/s, and the update took 6% longer
  (BENCHMARKS.md). On CUDA the packed layers' flash attention is traced into the layer's graph (aten's
  kernel, whose fake and backward torch has): one compiled region a layer, not two around an eager call
  (trainer/packing.py `_packed_kernel_call`). Elsewhere the attention call stays eager
  (`torch.compiler.disable`): a graph break. FSDP2's hooks sit on the module's __call__, outside the
  compiled forward; gradient checkpointing wraps __call__ too.
- the logprob head's per-chunk math (trainer/workers/logprobs.py), through `CompiledOrEager`.

Compilation can fail on a torch / driver combination we have not run. `CompiledOrEager` catches that on
the first call and runs the plain function from then on; decoder layers are checked by compiling and
running one layer copy forward and backward on a small input at setup (`probe_decoder_layer`): if that
fails, the model stays eager and the run says so once. CPU runs are not compiled by the trainer (the
C++ compile takes longer than it saves on a few cores).
"""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from trainer.model import autocast

log = logging.getLogger("trainer")


class CompiledOrEager:
    """`fn` through torch.compile; on the first failure, `fn` itself from then on.

    dynamic: torch.compile's. True makes every dimension symbolic from the first call; None ("automatic")
    compiles the first shapes statically and makes symbolic only the dimensions seen to change, so a
    dimension that never changes (the vocabulary) stays a constant the kernels are tuned for.
    dynamic_rows: make the first dimension of every tensor argument symbolic from the first call (with
    dynamic=None the rest stay static). Without it, the first call that brings a new row count (a packed
    batch's last, shorter chunk) compiles a second time, and when that is in the middle of training it
    costs a step seconds (a step-2 recompile was most of issue 24's "regression" on an H100).
    """

    def __init__(
        self,
        fn: Callable,
        *,
        backend: str | Callable = "inductor",
        dynamic: bool | None = True,
        dynamic_rows: bool = False,
    ) -> None:
        self.fn, self.backend, self.dynamic, self.dynamic_rows = fn, backend, dynamic, dynamic_rows
        self.enabled = True  # until the first compilation failure
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        if not self.enabled:
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=self.dynamic, backend=self.backend)
        if self.dynamic_rows:
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
        try:
            return self._compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compiler failure: say it once, run eagerly
            log.warning("torch.compile of %s failed (%s); it runs eagerly from now on", self.fn.__name__, exc)
            self.enabled = False
            return self.fn(*args, **kwargs)


# ------------------------------------------------------------------------------ decoder layers


def compile_decoder_layers(layers: list[nn.Module], *, backend: str | Callable = "inductor") -> None:
    """Replace every layer's forward by one compiled function of (layer, inputs); in place. Where the
    attention runs: see the module docstring."""
    if not layers:
        return
    compiled = _compiled_forward(type(layers[0]), backend)
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)


_COMPILED: dict[tuple[type, object], Callable] = {}


def _compiled_forward(layer_class: type, backend) -> Callable:
    key = (layer_class, backend)
    if key not in _COMPILED:
        compiled = torch.compile(layer_class.forward, dynamic=None, backend=backend)

        def forward(self, *args, **kwargs):
            _mark_token_dims(args[0] if args else kwargs["hidden_states"], (*args, *kwargs.values()))
            return compiled(self, *args, **kwargs)

        _COMPILED[key] = forward
    return _COMPILED[key]


def _mark_token_dims(hidden_states: torch.Tensor, values) -> None:
    """Mark the token dimension symbolic: hidden_states' second to last, and every argument's dimension
    of the same size (positions, rotary tables), so a new token count reuses the compiled code."""
    tokens = hidden_states.shape[-2]
    for value in values:
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                for dim, size in enumerate(tensor.shape):
                    if size == tokens:
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)


class _Captured(Exception):
    pass


def capture_layer_inputs(model: nn.Module, layer: nn.Module, model_kwargs: dict) -> tuple[tuple, dict]:
    """The exact (args, kwargs) `model` passes to `layer` for `model_kwargs` (its forward stops there)."""
    seen: list[tuple[tuple, dict]] = []

    def grab(_module, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**model_kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"{type(layer).__name__} was not called by the model's forward")
    return seen[0]


def probe_decoder_layer(
    layer: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None = None,
    backend: str | Callable = "inductor",
    train: bool = True,
) -> str | None:
    """Run a compiled copy of `layer` forward (and backward if `train`) on (args, kwargs) moved to
    `device` (floats in `dtype`, under `autocast_dtype`); None when that works, else the error. The real
    layers reuse what this compiled (one compiled function for every layer)."""
    probe = copy.deepcopy(layer).to(device=device, dtype=dtype)
    args, kwargs = _moved(args, device, dtype), _moved(kwargs, device, dtype)
    if args:
        args = (args[0].detach().requires_grad_(train), *args[1:])
    else:
        kwargs["hidden_states"] = kwargs["hidden_states"].detach().requires_grad_(train)
    compile_decoder_layers([probe], backend=backend)
    try:
        with autocast(device, autocast_dtype), torch.set_grad_enabled(train):
            out = probe(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if train:
            out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return None


def _moved(value, device: torch.device, dtype: torch.dtype | None):
    """Tensors (also inside tuples, lists and dicts) on `device`, floating ones in `dtype`."""
    if isinstance(value, torch.Tensor):
        moved = value.to(device)
        return moved.to(dtype) if dtype is not None and moved.is_floating_point() else moved
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device, dtype) for k, v in value.items()}
    return value


def compile_model(
    model: nn.Module,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None = None,
    backend: str | Callable = "inductor",
    train: bool = True,
) -> bool:
    """Compile every decoder layer of `model` if a probe copy of one compiles and runs on `device` (and
    trains, if `train`); returns whether it did (otherwise the run says why once and stays eager).
    dtype: the layers' compute dtype there (FSDP's param_dtype), autocast_dtype: the forward's autocast.
    """
    from trainer.parallel.fsdp import decoder_layers

    layers = decoder_layers(model)
    args, kwargs = capture_layer_inputs(model, layers[0], probe_inputs(model))
    problem = probe_decoder_layer(
        layers[0],
        args,
        kwargs,
        device=device,
        dtype=dtype,
        autocast_dtype=autocast_dtype,
        backend=backend,
        train=train,
    )
    if problem is not None:
        log.warning("decoder layers stay eager: torch.compile failed on a probe layer (%s)", problem)
        return False
    compile_decoder_layers(layers, backend=backend)
    return True


def probe_inputs(model: nn.Module) -> dict:
    """A two-sequence micro-batch in the layout the model trains on (packed when set up for it)."""
    from trainer.packing import is_packed, mask_spans, pack

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    device = next(model.parameters()).device
    if is_packed(model):
        kwargs = pack(ids, *mask_spans(mask)).model_kwargs()
    else:
        kwargs = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()} | {
        "use_cache": False
    }
