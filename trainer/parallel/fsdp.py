"""FSDP2 for the workers: sharding a Hugging Face model, moving it off the GPU, whole tensors for the
rollout engine, and sharded checkpoints that resume on any number of ranks.

Sharding (`shard_model`): each decoder layer is one FSDP unit (or `layers_per_unit` consecutive layers
are: one all-gather and one reduce-scatter, one set of hooks for them all), the root (embeddings, final
norm, LM head) another, as verl and torchtitan do; a role on one rank is one unit (`one_unit`). Mixed
precision is FSDP2's `MixedPrecisionPolicy`: the fp32 parameter shards are the master weights the optimizer
updates; each unit's parameters are cast to bf16 when gathered for compute (or, with verl's
`mixed_precision.param_dtype: fp32`, gathered in fp32 and computed under bf16 autocast, as one process
does), and gradients are reduced in fp32. Gradients are SUMMED across ranks (divide factor 1), because
each rank's loss is already its share of the global loss (see trainer/parallel/distributed.py).

Offload (verl's `fsdp_config` keys):
- `offload_policy`: FSDP2's CPUOffloadPolicy: parameter shards, gradients and the optimizer step live
  on the CPU; each unit is copied to the GPU for its forward and backward. Slow, smallest GPU footprint.
- `param_offload` / `optimizer_offload`: the shards (or the AdamW moments) stay on the GPU while the
  role computes and move to the CPU between its calls, so a colocated rollout engine gets the memory
  back for generation. `Offloader` does the moving.

Checkpoints (`save_sharded` / `load_sharded`): torch.distributed.checkpoint writes one file per rank
plus a metadata file describing every tensor's global shape; loading reads into whatever sharding
the loading ranks have, so N ranks save and M ranks resume. `load_full_model_state` rebuilds whole
tensors in one process (for exporting to Hugging Face) without any process group.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.parallel.distributed import DataParallel

log = logging.getLogger(__name__)

# FSDP2 warns at every forward whose root returns a view (transformers' last_hidden_state[0] does): an
# in-place op on it would skip the root's pre-backward hook. Our passes only read the hidden states
# (index_select, gather), and the root keeps its parameters gathered after forward (reshard_after_forward
# False below), so the warning is noise that looks like a bug to whoever reads the log.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True, kw_only=True)
class FSDPSettings:
    """How one role's model is sharded and where its state lives (verl's `*.fsdp_config`)."""

    param_dtype: torch.dtype | None = None  # compute dtype of gathered parameters; None: storage dtype
    reduce_dtype: torch.dtype = torch.float32  # gradient reduction across ranks
    reshard_after_forward: bool = True  # ZeRO-3; False keeps gathered params until backward (ZeRO-2)
    layers_per_unit: int = 1  # consecutive decoder layers sharded as one FSDP unit
    offload_policy: bool = False  # FSDP2 CPUOffloadPolicy
    param_offload: bool = False  # shards to CPU between calls
    optimizer_offload: bool = False  # AdamW moments to CPU between calls


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: modules whose class the model declares must not be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise TypeError(f"{type(model).__name__} names no decoder layer class (_no_split_modules)")
    return layers


def shard_model(
    model: nn.Module, dp: DataParallel, settings: FSDPSettings, device: torch.device
) -> nn.Module:
    """Shard `model` in place over the ranks of `dp` (FSDP2 `fully_shard`); returns it.

    The model must be fully materialised on the CPU or on `device`; gradient checkpointing, if wanted,
    is enabled before sharding.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dp.world_size,))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if settings.offload_policy
        else OffloadPolicy(),
    }
    if not settings.offload_policy:
        model.to(device)
    if not one_unit(dp, settings):
        layers, size = decoder_layers(model), settings.layers_per_unit
        for start in range(0, len(layers), size):  # FSDP2 shards a list of modules as one unit
            unit = layers[start : start + size]
            fully_shard(
                unit if size > 1 else unit[0], reshard_after_forward=settings.reshard_after_forward, **options
            )
    # the root's parameters (embeddings, LM head) are needed again right after the last layer's forward
    fully_shard(model, reshard_after_forward=False, **options)
    _install_root_forward(model)
    _sum_gradients(model)
    return model


def one_unit(dp: DataParallel, settings: FSDPSettings) -> bool:
    """Whether the whole model is one FSDP unit: on one rank with its parameters on the GPU.

    Units a layer exist to gather each layer from the other ranks just before it runs and free it
    after; one rank has no one to gather from, so they only cost host time (~1.75 ms a layer a forward
    on an H200 host: the copies in and out, the hooks), enough to leave the GPU idle in a 0.5B update's
    first forwards. One unit gathers (copies) the whole model once a forward and keeps the bf16 copy to
    the backward (`reshard_after_forward` has nothing to free); measured on one H200 (BENCHMARKS.md,
    2026-11-29): the profiled update's GPU idle 172 -> 83 ms and its peak memory 4 GB lower, its
    unprofiled wall time unchanged on that host. CPU offload keeps its units a layer, which bound how
    much of the model is on the GPU at once.
    """
    return dp.world_size == 1 and not settings.offload_policy


def release_gathered(model: nn.Module) -> None:
    """Free the gathered (unsharded) parameters a forward without gradients leaves behind: the root
    keeps them for a backward that will not come (reshard_after_forward=False), and a colocated engine
    wants the memory for generation."""
    for module in model.modules():
        if is_sharded(module):
            module.reshard()


ROOT_FORWARD = "forward_in_root"


def _install_root_forward(model: nn.Module) -> None:
    """Give the model a second forward method, `forward_in_root(fn, *args)` = fn(model, *args), that FSDP
    treats like forward(): the root's parameters are gathered around it and its backward is tracked.

    The workers call the backbone and the LM head separately (chunked logprobs), which plain forward()
    hooks would miss.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    def forward_in_root(fn, *args, **kwargs):
        return fn(model, *args, **kwargs)

    setattr(model, ROOT_FORWARD, forward_in_root)
    register_fsdp_forward_method(model, ROOT_FORWARD)


def in_root_forward(model: nn.Module, fn, *args, **kwargs):
    """fn(model, *args, **kwargs), inside one root forward when the model is FSDP-sharded."""
    runner = getattr(model, ROOT_FORWARD, None)
    return runner(fn, *args, **kwargs) if runner is not None else fn(model, *args, **kwargs)


def _sum_gradients(model: nn.Module) -> None:
    # FSDP averages gradients over ranks by default; our losses are global sums already (see module doc).
    # Plain SUM collectives (no pre-multiplied sum) also work with gloo.
    for module in model.modules():
        if not is_sharded(module):
            continue
        divide = (
            getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
        )
        divide(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> bool:
    return hasattr(model, "reshard") and hasattr(model, "unshard")


def compute_device(model: nn.Module) -> torch.device:
    """Where the model computes: its parameters' device, or CUDA when FSDP offloads them to the CPU."""
    parameter = next(model.parameters())
    if torch.cuda.is_available() and parameter.device.type == "cpu" and is_sharded(model):
        return torch.device("cuda", torch.cuda.current_device())
    return parameter.device


def full_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's whole value (a collective: every rank must ask, in the same order); others as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ------------------------------------------------------------------------------ offload between calls


class Offloader:
    """Moves a role's parameter shards and optimizer moments to the CPU between its calls.

    `with offloader.on_device():` brings them to the GPU for the duration of a call. A no-op on CPU
    and when neither `param_offload` nor `optimizer_offload` is set.
    """

    def __init__(self, model: nn.Module, optimizer, settings: FSDPSettings, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        active = device.type == "cuda" and not settings.offload_policy
        self.params = active and settings.param_offload
        self.moments = active and settings.optimizer_offload and optimizer is not None
        self.offload()

    def offload(self) -> None:
        if self.params:
            self.model.to("cpu")
        if self.moments:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
        if self.params or self.moments:
            torch.cuda.empty_cache()

    def load(self) -> None:
        if self.params:
            self.model.to(self.device)
        if self.moments:
            _move_optimizer_state(self.optimizer, self.device)

    @contextlib.contextmanager
    def on_device(self):
        self.load()
        try:
            yield
        finally:
            self.offload()


def _move_optimizer_state(optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ whole tensors for the engine


def iter_full_state(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) for every tensor of the model's state dict, one at a time, on the compute device.

    A collective when sharded: every rank iterates fully, in the same order. Tied tensors (embeddings
    shared with the LM head) are yielded under each name but gathered once. `dtype` casts each tensor
    (e.g. bf16 for the rollout engine).
    """
    device = compute_device(model)
    state = model.state_dict(keep_vars=True)  # the parameters themselves, so ties share an id
    uses = Counter(id(tensor) for tensor in state.values())
    tied: dict[int, Tensor] = {}
    for name, tensor in state.items():
        key = id(tensor)
        whole = tied.get(key)
        if whole is None:
            whole = full_tensor(tensor.detach().to(device))
            whole = whole.to(dtype) if dtype is not None else whole
        uses[key] -= 1
        if uses[key] > 0:
            tied[key] = whole
        else:
            tied.pop(key, None)
        yield name, whole


def iter_gathered(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """iter_full_state's (name, whole tensor) pairs, gathered a whole FSDP group at a time: FSDP2's
    `unshard()`, one all-gather of a decoder layer's parameters in the gather dtype, where full_tensor()
    makes one collective, and its host work, per tensor (~290 for a 0.5B model: the weight sync was
    host-bound, 53 ms on one GPU and 167 on four). Each tensor is a copy, as a group is resharded before
    the next is gathered. A collective; a model that is not sharded goes through iter_full_state."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield from iter_full_state(model, dtype)
        return
    with torch.no_grad():
        for unit, tensors in _gather_plan(model):
            unit.unshard()
            try:
                for names, holder, attribute in tensors:
                    whole = getattr(holder, attribute)  # the unsharded parameter while gathered
                    copy = whole.detach().to(dtype or whole.dtype, copy=True)
                    for name in names:
                        yield name, copy
            finally:
                unit.reshard()


_GATHER_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gather_plan(model: nn.Module) -> list[tuple[nn.Module, list[tuple[list[str], nn.Module, str]]]]:
    """iter_gathered's walk, worked out once a model (it was a third of a weight sync's host time, each
    step): every FSDP unit, by its first module, and its tensors as (their state-dict names, the module
    holding the tensor, its attribute name). Tied tensors (embeddings and LM head) share one entry, in
    the unit of the deepest group whose prefix holds their first name."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if model in _GATHER_PLANS:
        return _GATHER_PLANS[model]
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    groups = [(prefix, module) for prefix, module in model.named_modules() if isinstance(module, FSDPModule)]
    unit_of: dict[int, int] = {}  # the modules of a unit share its state: its first one's index
    for index, (_, module) in enumerate(groups):
        unit_of.setdefault(id(fully_shard.state(module)), index)

    def unit(name: str) -> int:
        holders = [i for i, (prefix, _) in enumerate(groups) if not prefix or name.startswith(prefix + ".")]
        deepest = max(holders, key=lambda i: len(groups[i][0]))
        return unit_of[id(fully_shard.state(groups[deepest][1]))]

    owned: dict[int, list] = {}
    for names in names_of.values():
        path, _, attribute = names[0].rpartition(".")
        owned.setdefault(unit(names[0]), []).append((names, model.get_submodule(path), attribute))
    plan = [(module, owned[index]) for index, (_, module) in enumerate(groups) if index in owned]
    _GATHER_PLANS[model] = plan
    return plan


def buckets(named: Iterator[tuple[str, Tensor]], max_bytes: int) -> Iterator[dict[str, Tensor]]:
    """Group consecutive (name, tensor) pairs into dicts of at most ~max_bytes (one tensor may exceed it)."""
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, tensor in named:
        bytes_ = tensor.numel() * tensor.element_size()
        if bucket and size + bytes_ > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += bytes_
    if bucket:
        yield bucket


# ------------------------------------------------------------------------------ sharded checkpoints


def save_sharded(directory: Path, model: nn.Module, optimizer=None, *, aliases: dict | None = None) -> None:
    """Every rank writes its shards of the model (and optimizer) into `directory` (a collective).

    `aliases` (tied names -> the name they share storage with) are left out: stored once.
    """
    model_state = get_model_state_dict(model)
    state = {"model": {k: v for k, v in model_state.items() if k not in (aliases or {})}}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory), no_dist=not _distributed())


def load_sharded(directory: Path, model: nn.Module, optimizer=None, *, aliases: dict | None = None) -> None:
    """Read `directory` into this rank's shards, whatever number of ranks wrote it (a collective)."""
    aliases = aliases or {}
    model_state = get_model_state_dict(model)
    state = {"model": {k: v for k, v in model_state.items() if k not in aliases}}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory), no_dist=not _distributed())
    loaded = {**state["model"], **{alias: state["model"][stored] for alias, stored in aliases.items()}}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=True))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def has_sharded_checkpoint(directory: Path) -> bool:
    return (Path(directory) / ".metadata").is_file()


def load_full_model_state(directory: Path) -> dict[str, Tensor]:
    """The whole model tensors of a sharded checkpoint, in this process, on the CPU (no process group)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}
