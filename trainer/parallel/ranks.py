"""What one rank of each role does: load its model, shard it (FSDP2), and serve its group.

A rank is the unit of every run: the group (trainer/parallel/groups.py) builds one per GPU, in this
process (one rank: CPU runs, one GPU) or in Ray actors, constructed where the rank lives: models are
loaded there from their path, never shipped from the driver. Each class wraps the
math of its role (trainer/workers/policy.py, reference.py, critic.py) around the sharded model and adds
what only a rank needs: moving its state off the GPU between calls, sharded checkpoints, and, for the
policy, the colocated rollout engine and the weight sync into it.

Rollout (colocated): every policy rank runs a rollout engine on its own whole copy of the model
(trainer/workers/engines.py) and serves it as a replica of the driver's rollout manager. After an
update, the ranks gather the policy's parameters a decoder layer at a time (`iter_gathered`, FSDP2's
unshard: a collective) and hand them to their engine in buckets of ~256 MB. Separate rollout servers
(SGLang's HTTP API) get the weights as a checkpoint folder that rank 0 writes (`save_hf_weights`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint import ALL_CONTENTS, HF_METADATA_DIR, load_role_state, save_role_state
from trainer.compiling import compile_model
from trainer.config.derive import TokenizerSource
from trainer.parallel.distributed import DataParallel
from trainer.parallel.fsdp import (
    FSDPSettings,
    Offloader,
    buckets,
    compute_device,
    iter_full_state,
    iter_gathered,
    shard_model,
)
from trainer.model import load_critic, load_policy, load_reference, load_tokenizer, without_cudnn_attention
from trainer.packing import shares_prompts, use_packed_attention
from trainer.workers.policy import Policy, PolicyLossSettings
from trainer.workers.common import MicroBatchSize, OptimizerSettings, UpdateSettings
from trainer.workers.critic import Critic, ValueLossSettings
from trainer.workers.engines import EngineSettings, colocated_replica
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
    share_prompts: bool = False  # packed: a group's rows share their prompt's pass (packing.pack_shared)
    compile: bool = False  # torch.compile the decoder layers on CUDA (trainer/compiling.py)
    # autocast of the role's passes (bf16 on GPUs, as in one process), whatever dtype FSDP gathers in
    autocast_dtype: torch.dtype | None = None
    fsdp: FSDPSettings = dataclasses.field(default_factory=FSDPSettings)
    # the driver's tokenizer (data.tokenizer: trainer/config/derive.py `tokenizer_source`), which the
    # policy's engine stops with and checkpoints save; None: the model folder's own
    tokenizer: TokenizerSource | None = None

    @property
    def tokenizer_source(self) -> TokenizerSource:
        return self.tokenizer or TokenizerSource(self.path, self.trust_remote_code)

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
        use_packed_attention(model, share_prompts=settings.share_prompts)
    if device.type == "cuda":  # padded micro-batches run SDPA at a new shape nearly every time
        without_cudnn_attention()
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


class _TrainedRank:
    """A trainable role's rank: its update, and sharded save / load of its model, AdamW and LR schedule
    into a role directory."""

    trained: Policy | Critic
    offloader: Offloader
    dp: DataParallel
    device: torch.device
    tokenizer_source: TokenizerSource  # saved beside the HF config, for trainer.export

    def update(self, shard) -> dict[str, float]:
        with self.offloader.on_device():
            return self.trained.update(shard) | peak_memory(self.device)

    def save(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        tokenizer = None
        if self.dp.rank == 0:
            source = self.tokenizer_source
            tokenizer = load_tokenizer(source.path, trust_remote_code=source.trust_remote_code)
        with self.offloader.on_device():
            save_role_state(
                Path(directory),
                self.trained.model,
                self.trained.optimizer,
                self.trained.scheduler,
                tokenizer=tokenizer,
                writer=self.dp.rank == 0,
                contents=contents,
            )
        if "hf_model" in contents:  # beside the config and tokenizer save_role_state wrote there
            self.save_hf_weights(str(Path(directory) / HF_METADATA_DIR))

    def load(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        with self.offloader.on_device():
            load_role_state(
                Path(directory),
                self.trained.model,
                self.trained.optimizer,
                self.trained.scheduler,
                contents=contents,
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


class PolicyRank(_TrainedRank):
    def __init__(self, settings: PolicyRankSettings, dp: DataParallel, device: torch.device) -> None:
        model = _loaded(
            load_policy, settings.model, device, gradient_checkpointing=settings.model.gradient_checkpointing
        )
        # the engine copies the whole weights before they are sharded: no second read from disk
        self.replica = None
        if settings.engine is not None:
            source = settings.model.tokenizer_source
            tokenizer = load_tokenizer(source.path, trust_remote_code=source.trust_remote_code)
            self.replica = colocated_replica(
                settings.engine,
                model,
                tokenizer,
                device=device,
                model_path=settings.model.path,
                trust_remote_code=settings.model.trust_remote_code,
                name=f"policy rank {dp.rank}",
            )
        model = shard_model(model, dp, settings.model.fsdp, device)
        self.dp, self.device, self.tokenizer_source = dp, device, settings.model.tokenizer_source
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

    def profile(self) -> PolicyProfile:
        return PolicyProfile.of(self.trained.model, self.trained.update_settings.ppo_epochs)

    def compute_logprobs(self, shard, with_entropy: bool = False):
        with self.offloader.on_device():
            return self.trained.compute_logprobs(shard, with_entropy=with_entropy)

    def replica_capacity(self) -> int | None:
        return self.replica.capacity

    def sync_weights(self) -> float:
        """Copy the current policy into this rank's engine (a collective); returns the seconds it took."""
        start = time.perf_counter()
        with self.offloader.on_device():
            for bucket in buckets(iter_gathered(self.trained.model, self.replica.dtype), SYNC_BUCKET_BYTES):
                self.replica.load_weights_now(bucket)
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

    def close(self) -> None:
        """Stop the engine's thread (the built-in engine's; idempotent, as the manager may have)."""
        worker = getattr(self.replica, "worker", None)
        if worker is not None:
            worker.close()


@dataclass(frozen=True)
class PolicyProfile:
    """What MFU needs to know of the policy: its size, its epochs and the GPU it trains on (None: CPU)."""

    num_params: int
    num_layers: int
    hidden_size: int
    ppo_epochs: int
    device_name: str | None
    shares_prompts: bool = False  # model.share_prompts: a group's prompt goes through the layers once

    @classmethod
    def of(cls, model: torch.nn.Module, ppo_epochs: int) -> PolicyProfile:
        on_gpu = compute_device(model).type == "cuda"
        return cls(
            num_params=sum(p.numel() for p in model.parameters()),  # DTensors count their global size
            num_layers=model.config.num_hidden_layers,
            hidden_size=model.config.hidden_size,
            ppo_epochs=ppo_epochs,
            device_name=torch.cuda.get_device_name() if on_gpu else None,
            shares_prompts=shares_prompts(model),
        )


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


# ------------------------------------------------------------------------------ critic


@dataclass(frozen=True, kw_only=True)
class CriticRankSettings:
    model: ModelSettings
    optim: OptimizerSettings
    update: UpdateSettings  # GLOBAL sizes
    loss: ValueLossSettings
    forward_micro_batch_size: MicroBatchSize | None = None


class CriticRank(_TrainedRank):
    def __init__(self, settings: CriticRankSettings, dp: DataParallel, device: torch.device) -> None:
        model = _sharded(
            load_critic,
            settings.model,
            dp,
            device,
            gradient_checkpointing=settings.model.gradient_checkpointing,
        )
        self.dp, self.device, self.tokenizer_source = dp, device, settings.model.tokenizer_source
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
