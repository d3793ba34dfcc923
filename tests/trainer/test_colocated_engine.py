"""The engine next to the policy: KV slots sized from rollout.gpu_memory_utilization, the KV cache held only
through a rollout phase (the manager's resume / release), bucketed weight updates, and which engine
rollout.name picks on which device."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from tests.trainer.test_rollout_engine import encode, varied_model
from trainer.config import checks, load_config
from trainer.rollout.base import SamplingParams
from trainer.rollout.builtin.memory import DeviceMemory, kv_slots, reserve_bytes, slot_bytes
from trainer.rollout.builtin.model import ModelShape
from trainer.rollout.manager import RolloutManager
from trainer.rollout.pool import ReplicaPool
from trainer.workers.engines import KV_CACHE, EngineSettings, colocated_replica

GiB = 2**30
# Qwen2.5-0.5B: 24 layers, 2 KV heads of 64 dims, vocab 151936
QWEN_05B = ModelShape(
    vocab=151936,
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    head_dim=64,
    intermediate=4864,
    rms_eps=1e-6,
    rope_theta=1e6,
    qkv_bias=True,
    qk_norm=False,
    tied_embeddings=True,
    max_positions=32768,
)


def test_slot_bytes_and_the_slot_count_follow_the_budget():
    # a 768-token slot: 2 (k, v) x 24 layers x 2 heads x 768 x 64 dims x 2 bytes = 9,437,184 bytes of KV,
    # plus a 151936-entry logits row in bf16 (2 bytes) and two fp32 copies (8 bytes): 1,519,360 bytes
    assert slot_bytes(QWEN_05B, 768, torch.bfloat16) == 9_437_184 + 1_519_360
    per_slot = 10_956_544
    reserve = reserve_bytes(QWEN_05B, 16384, torch.bfloat16)
    weights = 1 * GiB
    # 80 GiB GPU, utilization 0.5, nearly all free: 40 GiB - 1 GiB weights - reserve, minus the scratch slot
    free = DeviceMemory(total=80 * GiB, available=70 * GiB)
    expected = (40 * GiB - weights - reserve) // per_slot - 1
    sized = kv_slots(
        QWEN_05B,
        context=768,
        dtype=torch.bfloat16,
        memory=free,
        utilization=0.5,
        weights_bytes=weights,
        max_prefill_tokens=16384,
        cap=100_000,
    )
    assert sized == expected and 3500 < sized < 3800
    # the trainer holds most of the GPU: what is free now is the limit, not the utilization
    busy = DeviceMemory(total=80 * GiB, available=12 * GiB)
    assert (
        kv_slots(
            QWEN_05B,
            context=768,
            dtype=torch.bfloat16,
            memory=busy,
            utilization=0.5,
            weights_bytes=weights,
            max_prefill_tokens=16384,
            cap=100_000,
        )
        == (12 * GiB - reserve) // per_slot - 1
    )
    # the cap, and nothing at all when even one slot does not fit
    common = {"context": 768, "dtype": torch.bfloat16, "weights_bytes": weights, "max_prefill_tokens": 16384}
    assert kv_slots(QWEN_05B, memory=free, utilization=0.5, cap=512, **common) == 512
    assert kv_slots(QWEN_05B, memory=free, utilization=0.02, cap=512, **common) == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_slots(QWEN_05B, memory=free, utilization=1.5, cap=512, **common)


def cpu_builtin_replica(model, tok):
    """A policy rank's built-in engine on the CPU, as colocated_replica builds it."""
    return colocated_replica(
        EngineSettings(name="builtin", context_length=96),
        model,
        tok,
        device=torch.device("cpu"),
        model_path="unused by builtin",
        trust_remote_code=False,
        name="rank 0",
    )


def test_the_kv_cache_exists_only_in_a_rollout_phase_and_weights_update_in_buckets():
    model, tok = varied_model("qwen2", seed=3)
    replica = cpu_builtin_replica(model, tok)
    manager = RolloutManager(ReplicaPool([replica]))
    inner = replica.engine  # the BuiltinEngine behind the replica
    try:
        assert inner.released == {"kv_cache"} and inner.cache is None  # nothing held until a rollout phase
        prompts = encode(tok)[:3]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        asyncio.run(manager.resume_memory_async(KV_CACHE))
        before = [r.response_ids.tolist() for r in manager.generate(prompts, greedy)]
        asyncio.run(manager.release_memory_async(KV_CACHE))
        assert inner.released == {"kv_cache"} and inner.cache is None  # released again once done
        # the policy moves on; its tensors reach the engine in two buckets (a subset each), cache released
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        state = moved.state_dict()
        names = sorted(state)
        replica.load_weights_now({name: state[name] for name in names[: len(names) // 2]})
        replica.load_weights_now({name: state[name] for name in names[len(names) // 2 :]})
        asyncio.run(manager.resume_memory_async(KV_CACHE))
        after = [r.response_ids.tolist() for r in manager.generate(prompts, greedy)]
        from trainer.rollout.builtin import load_engine

        reference = load_engine(moved, tokenizer=tok, dtype=torch.float32, device="cpu")
        expected = [g[0].token_ids for g in reference.generate(prompts, greedy)]
        assert after == expected and after != before
    finally:
        manager.close()


@pytest.mark.parametrize("free", [True, False])
def test_the_fit_loop_frees_the_kv_cache_after_each_rollout_phase_only_when_asked(free):
    """rollout.free_cache_engine (verl's key): true releases the cache (and graphs) after every rollout
    phase; false keeps the one allocated in the first phase, so later phases allocate nothing."""
    from types import SimpleNamespace

    from trainer.collect import rollout_phase

    model, tok = varied_model("qwen2", seed=3)
    replica = cpu_builtin_replica(model, tok)
    manager = RolloutManager(ReplicaPool([replica]))
    inner = replica.engine
    cfg = load_config([f"actor_rollout_ref.rollout.free_cache_engine={str(free).lower()}"])
    run = SimpleNamespace(colocated=True, rollout=manager, cfg=cfg)  # the three fields rollout_phase reads

    async def two_phases() -> list:
        caches, timings = [], {}
        for _ in range(2):
            async with rollout_phase(run, timings):
                caches.append(inner.cache)
        assert timings["kv_memory"] > 0  # timing_s/kv_memory: the resume and the release
        return caches

    try:
        first, second = asyncio.run(two_phases())
        assert first is not None and second is not None  # held during each phase either way
        if free:
            assert inner.released == {"kv_cache"} and inner.cache is None and second is not first
        else:
            assert not inner.released and inner.cache is first and second is first
    finally:
        manager.close()


@pytest.mark.parametrize(
    ("name", "device", "engine"),
    [
        ("auto", "cpu", "builtin"),
        ("auto", "cuda", "builtin"),
        ("vllm", "cpu", "builtin"),
        ("vllm", "cuda", "builtin"),
        ("hf", "cuda", "hf"),
        ("builtin", "cpu", "builtin"),
    ],
)
def test_which_engine_generates(name, device, engine):
    config = load_config([f"actor_rollout_ref.rollout.name={name}", f"trainer.device={device}"], check=False)
    assert config.actor_rollout_ref.rollout.engine == engine
    notices = [line for line in checks.notices(config) if line.startswith("rollout: ")]
    if name == "vllm":
        assert notices == [
            "rollout: actor_rollout_ref.rollout.name=vllm is not wired in yet; the built-in engine "
            "(continuous batching, on each policy rank) generates instead"
        ]
    else:
        assert notices == []


@pytest.mark.parametrize("name", ["auto", "builtin"])
def test_a_model_the_builtin_engine_refuses_generates_with_hf_only_under_auto(name, tmp_path, caplog):
    # Llama 3's scaled RoPE (here linear scaling on a tiny Qwen2) is outside what the built-in engine runs
    from testing.tiny import load_tiny_tokenizer, make_tiny_model, tiny_qwen2_config
    from trainer.model import load_policy
    from trainer.parallel.settings import engine_settings
    from trainer.rollout.hf_engine import HFReplica

    tok = load_tiny_tokenizer("char")
    config = tiny_qwen2_config(vocab=len(tok))
    config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    path = make_tiny_model(tmp_path / "scaled_rope", config=config)
    model = load_policy(str(path), device=torch.device("cpu"))
    rollout = load_config([f"actor_rollout_ref.rollout.name={name}"], check=False).actor_rollout_ref.rollout
    rollout.prompt_length, rollout.response_length = 32, 8

    def replica():
        return colocated_replica(
            engine_settings(rollout),
            model,
            tok,
            device=torch.device("cpu"),
            model_path=str(path),
            trust_remote_code=False,
            name="rank 0",
        )

    if name == "builtin":  # asked for by name: refused, with the reason
        with pytest.raises(ValueError, match="default RoPE only, not rope_type='linear'"):
            replica()
        return
    hf = replica()
    assert isinstance(hf, HFReplica)
    assert "rope_type='linear'; transformers (hf) generates instead" in caplog.text
    manager = RolloutManager(ReplicaPool([hf]))
    try:
        prompt = encode(tok)[0]
        sampling = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        assert len(manager.generate([prompt], sampling)[0].response_ids) == 4
    finally:
        manager.close()
