"""What one rank of each role does in its own process: load its model, shard it, and serve the group.

Each class wraps the single-process worker of its role (trainer/workers/actor.py, reference.py,
critic.py) around an FSDP2-sharded model and adds what only a rank needs: moving its state off the GPU
between calls, sharded checkpoints, and, for the policy, the colocated rollout engine and the weight
sync into it. The group (trainer/workers/group.py) builds one per rank through `build_*`, which run
inside the rank's process: models are loaded there from their path, never shipped from the driver.

Weight sync (colocated): every policy rank runs a rollout engine on its own whole bf16 copy of the
model (trainer/workers/engines.py: the built-in fast engine by default). After an update, the ranks
gather the policy's parameters tensor by tensor (`iter_full_state`, a collective) and hand them to their
engine in buckets of ~256 MB (`load_weights` of a subset of the named tensors). The engine's KV cache
exists only while it generates, so the training passes have that memory. Separate rollout servers
(SGLang's HTTP API) get the weights as a checkpoint folder that rank 0 writes (`save_hf_weights`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint import load_role_state, save_role_state
from trainer.compiling import compile_model
from trainer.distributed import DataParallel
from trainer.fsdp import (
    FSDPSettings,
    Offloader,
    buckets,
    iter_full_state,
    shard_model,
)
from trainer.model import load_critic, load_policy, load_reference, load_tokenizer
from trainer.packing import use_packed_attention
from trainer.rollout.base import Rollout, SamplingParams
from trainer.workers.actor import Policy, PolicyLossSettings
from trainer.workers.common import MicroBatchSize, OptimizerSettings, UpdateSettings
from trainer.workers.critic import Critic, ValueLossSettings
from trainer.workers.engines import EngineSettings, builtin_engine, hf_engine_copy
from trainer.workers.group import PolicyProfile
from trainer.workers.logprobs import LogprobHead
from trainer.workers.reference import Reference

SYNC_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """Where a role's model comes from and how each rank holds it."""

    path: str
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    remove_padding: bool = False  # pack each micro-batch's sequences (trainer/packing.py)
    compile: bool = False  # torch.compile the decoder layers on CUDA (trainer/compiling.py)
    # autocast of the role's passes (bf16 on GPUs, as in one process), whatever dtype FSDP gathers in
    autocast_dtype: torch.dtype | None = None
    fsdp: FSDPSettings = dataclasses.field(default_factory=FSDPSettings)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fsdp.param_dtype or self.autocast_dtype or torch.float32


def _loaded(loader: Callable, settings: ModelSettings, device: torch.device, **extra):
    """The role's model in fp32 on the CPU, set up for packed forwards and compiled layers as asked:
    ready to shard."""
    model = loader(
        settings.path,
        device="cpu",
        param_dtype=torch.float32,
        trust_remote_code=settings.trust_remote_code,
        **extra,
    )
    if settings.remove_padding:
        use_packed_attention(model)
    if settings.compile and device.type == "cuda":
        trains = any(p.requires_grad for p in model.parameters())
        compile_model(
            model,
            device=device,
            dtype=settings.fsdp.param_dtype,
            autocast_dtype=settings.autocast_dtype,
            train=trains,
        )
    return model


def _sharded(loader: Callable, settings: ModelSettings, dp: DataParallel, device: torch.device, **extra):
    return shard_model(_loaded(loader, settings, device, **extra), dp, settings.fsdp, device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """perf/max_memory_*_gb of this rank's GPU (GiB); nothing on CPU."""
    if device.type != "cuda":
        return {}
    return {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def per_rank(update: UpdateSettings, world_size: int) -> UpdateSettings:
    """The group splits each global mini-batch over the ranks: a rank's mini-batch is 1/W of it."""
    if update.mini_batch_size % world_size:
        raise ValueError(
            f"the mini-batch ({update.mini_batch_size} sequences) must split evenly over {world_size} ranks"
        )
    return dataclasses.replace(update, mini_batch_size=update.mini_batch_size // world_size)


class _Checkpointed:
    """Sharded save / load of a trainable role (model, AdamW, LR schedule) into a role directory."""

    trained: Policy | Critic
    offloader: Offloader
    dp: DataParallel
    hf_source: str

    def save(self, directory: str) -> None:
        tokenizer = load_tokenizer(self.hf_source) if self.dp.rank == 0 else None
        with self.offloader.on_device():
            save_role_state(
                Path(directory),
                self.trained.model,
                self.trained.optimizer,
                self.trained.scheduler,
                tokenizer=tokenizer,
                writer=self.dp.rank == 0,
            )

    def load(self, directory: str) -> None:
        with self.offloader.on_device():
            load_role_state(
                Path(directory), self.trained.model, self.trained.optimizer, self.trained.scheduler
            )


# ------------------------------------------------------------------------------ policy


@dataclass(frozen=True, kw_only=True)
class PolicyRankSettings:
    model: ModelSettings
    optim: OptimizerSettings
    update: UpdateSettings  # GLOBAL sizes: the group splits every mini-batch over the ranks
    loss: PolicyLossSettings
    temperature: float = 1.0
    log_prob_micro_batch_size: MicroBatchSize | None = None
    head: LogprobHead = LogprobHead()
    engine: EngineSettings | None = None  # None: no colocated engine (generation runs elsewhere)


class PolicyRank(_Checkpointed):
    def __init__(self, settings: PolicyRankSettings, dp: DataParallel, device: torch.device) -> None:
        model = _loaded(
            load_policy, settings.model, device, gradient_checkpointing=settings.model.gradient_checkpointing
        )
        # the engine copies the whole weights before they are sharded: no second read from disk
        self.engine = _colocated_engine(settings, model, device) if settings.engine is not None else None
        model = shard_model(model, dp, settings.model.fsdp, device)
        self.dp, self.device, self.hf_source = dp, device, settings.model.path
        self.compute_dtype = settings.model.compute_dtype
        self.trained = Policy(
            model,
            settings.optim,
            per_rank(settings.update, dp.world_size),
            settings.loss,
            temperature=settings.temperature,
            log_prob_micro_batch_size=settings.log_prob_micro_batch_size,
            autocast_dtype=settings.model.autocast_dtype,
            head=settings.head,
            dp=dp,
        )
        self.offloader = Offloader(model, self.trained.optimizer, settings.model.fsdp, device)

    def update(self, shard) -> dict[str, float]:
        with self.offloader.on_device():
            return self.trained.update(shard) | peak_memory(self.device)

    def profile(self) -> PolicyProfile:
        return PolicyProfile.of(self.trained.model, self.trained.update_settings.ppo_epochs, in_process=False)

    def compute_logprobs(self, shard, with_entropy: bool = False):
        with self.offloader.on_device():
            return self.trained.compute_logprobs(shard, with_entropy=with_entropy)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        return self.engine.generate(prompt_ids, sampling) if prompt_ids else []

    def sync_weights(self) -> float:
        """Copy the current policy into this rank's engine (a collective); returns the seconds it took."""
        start = time.perf_counter()
        with self.offloader.on_device():
            for bucket in buckets(iter_full_state(self.trained.model, self.engine.dtype), SYNC_BUCKET_BYTES):
                self.engine.load_weights(bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def save_hf_weights(self, folder: str) -> None:
        """Rank 0 writes the current policy as a transformers checkpoint (config + safetensors in the
        compute dtype: bf16 on GPU) into `folder`, for rollout servers to load (a collective)."""
        from safetensors.torch import save_file

        writer = self.dp.rank == 0
        tensors = {}
        with self.offloader.on_device():
            for name, tensor in iter_full_state(self.trained.model, self.compute_dtype):
                if writer:
                    tensors[name] = tensor.to("cpu", copy=True)
        if writer:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.trained.model.config.save_pretrained(folder)
            save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def _colocated_engine(settings: PolicyRankSettings, model: torch.nn.Module, device: torch.device):
    engine = settings.engine
    trust = settings.model.trust_remote_code
    tokenizer = load_tokenizer(settings.model.path, trust_remote_code=trust)
    if engine.name == "hf":
        return hf_engine_copy(
            settings.model.path,
            tokenizer,
            device=device,
            trust_remote_code=trust,
            max_batch_size=engine.max_batch_size,
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return builtin_engine(
        model,
        tokenizer,
        device=device,
        context_length=engine.context_length,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_slots=engine.max_slots,
        pad_id=pad_id,
    )


def build_policy(settings: PolicyRankSettings, dp: DataParallel, device: torch.device) -> PolicyRank:
    return PolicyRank(settings, dp, device)


# ------------------------------------------------------------------------------ reference


@dataclass(frozen=True, kw_only=True)
class ReferenceRankSettings:
    model: ModelSettings
    temperature: float = 1.0
    micro_batch_size: MicroBatchSize = 8
    head: LogprobHead = LogprobHead()


class ReferenceRank:
    def __init__(self, settings: ReferenceRankSettings, dp: DataParallel, device: torch.device) -> None:
        model = _sharded(load_reference, settings.model, dp, device)
        self.reference = Reference(
            model,
            temperature=settings.temperature,
            micro_batch_size=settings.micro_batch_size,
            autocast_dtype=settings.model.autocast_dtype,
            head=settings.head,
            dp=dp,
        )
        self.offloader = Offloader(model, None, settings.model.fsdp, device)

    def compute_logprobs(self, shard):
        with self.offloader.on_device():
            return self.reference.compute_logprobs(shard)


def build_reference(settings: ReferenceRankSettings, dp: DataParallel, device: torch.device) -> ReferenceRank:
    return ReferenceRank(settings, dp, device)


# ------------------------------------------------------------------------------ critic


@dataclass(frozen=True, kw_only=True)
class CriticRankSettings:
    model: ModelSettings
    optim: OptimizerSettings
    update: UpdateSettings  # GLOBAL sizes
    loss: ValueLossSettings
    forward_micro_batch_size: MicroBatchSize | None = None


class CriticRank(_Checkpointed):
    def __init__(self, settings: CriticRankSettings, dp: DataParallel, device: torch.device) -> None:
        model = _sharded(
            load_critic,
            settings.model,
            dp,
            device,
            gradient_checkpointing=settings.model.gradient_checkpointing,
        )
        self.dp, self.device, self.hf_source = dp, device, settings.model.path
        self.trained = Critic(
            model,
            settings.optim,
            per_rank(settings.update, dp.world_size),
            settings.loss,
            forward_micro_batch_size=settings.forward_micro_batch_size,
            autocast_dtype=settings.model.autocast_dtype,
            dp=dp,
        )
        self.offloader = Offloader(model, self.trained.optimizer, settings.model.fsdp, device)

    def compute_values(self, shard):
        with self.offloader.on_device():
            return self.trained.compute_values(shard)

    def update(self, shard) -> dict[str, float]:
        with self.offloader.on_device():
            return self.trained.update(shard) | peak_memory(self.device)


def build_critic(settings: CriticRankSettings, dp: DataParallel, device: torch.device) -> CriticRank:
    return CriticRank(settings, dp, device)
