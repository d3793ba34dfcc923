"""The distributed trainer's pure parts, in one process: dealing rows to ranks balanced by tokens,
putting per-rank results back in order, packed (padding-free) forwards, sharded checkpoint files and the
tensor-by-tensor weight stream. The Ray / FSDP tests are in test_distributed.py."""

import pytest
import torch

from testing.tiny import make_tiny_model
from trainer.batch import TrainBatch
from trainer.parallel.distributed import SINGLE_PROCESS, Scatter, balanced_partition, shard_rows
from trainer.parallel.fsdp import buckets, iter_full_state, load_full_model_state, load_sharded, save_sharded
from trainer.model import backbone_and_head, load_policy
from trainer.packing import (
    pack_shared,
    shared_prompt_tokens,
    ResponseTokens,
    mask_spans,
    pack,
    pack_batch,
    response_hidden_states,
    use_packed_attention,
)
from trainer.rollout.base import Rollout
from trainer.workers.logprobs import response_logprobs


def test_ranks_get_nccl_settings_this_checkout_and_the_drivers_allocator_settings(monkeypatch):
    from trainer.parallel.placement import rank_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    env = rank_env()
    assert env["NCCL_NVLS_ENABLE"] == "0" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert rank_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_balanced_partition_gives_equal_counts_and_even_tokens():
    # sorted heaviest first: 10 -> g0, 10 -> g1, 5 -> g0 (15), 5 -> g1 (15), 1 -> g0 (16), 1 -> g1 (16)
    weights = [10, 1, 1, 10, 5, 5]
    groups = balanced_partition(weights, 2)
    assert groups == [[0, 1, 4], [2, 3, 5]]
    assert [sum(weights[i] for i in g) for g in groups] == [16, 16]
    # a plain contiguous split would give 16 / 16 here by luck; this one would not: [9, 9, 1, 1] -> 18 / 2
    assert [sum([9, 9, 1, 1][i] for i in g) for g in balanced_partition([9, 9, 1, 1], 2)] == [10, 10]
    with pytest.raises(ValueError, match="do not split evenly over 4 ranks"):
        balanced_partition(weights, 4)


def test_shard_rows_splits_every_mini_batch_over_the_ranks():
    weights = [1, 2, 3, 4, 50, 60, 70, 80, 5, 5]  # mini-batches of 4: [0..3], [4..7], then a short [8, 9]
    shards = shard_rows(weights, 2, chunk=4)
    # each rank holds 2 rows of mini-batch 0, then 2 of mini-batch 1, then 1 of the short last one
    for rank_rows in shards:
        assert [r // 4 for r in rank_rows] == [0, 0, 1, 1, 2]
    assert sorted(shards[0] + shards[1]) == list(range(10))
    assert sum(weights[i] for i in shards[0][2:4]) == sum(weights[i] for i in shards[1][2:4]) == 130
    with pytest.raises(ValueError, match="mini-batch of 3 sequences does not split evenly over 2"):
        shard_rows([1] * 7, 2, chunk=4)
    # trainer.balance_batch=false: consecutive runs of each mini-batch
    assert shard_rows(weights[:8], 2, chunk=4, balance=False) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_shard_rows_deals_whole_groups_to_a_role_that_shares_prompts():
    # 4 groups of 3 (a prompt's samples, consecutive) in one mini-batch of 12 over 2 ranks
    groups = [7, 7, 7, 2, 2, 2, 9, 9, 9, 4, 4, 4]
    weights = [30, 30, 30, 1, 1, 1, 20, 20, 20, 9, 9, 9]
    shards = shard_rows(weights, 2, groups=groups)
    assert sorted(shards[0] + shards[1]) == list(range(12))
    for rank_rows in shards:  # each group's rows on one rank, so each rank runs its prompts once
        assert len(rank_rows) == 6 and all(
            len({groups[i] for i in rank_rows[k : k + 3]}) == 1 for k in (0, 3)
        )
    # balanced by the groups' tokens: 90 + 3 against 60 + 27
    assert sorted(sum(weights[i] for i in rows) for rows in shards) == [87, 93]
    # row by row where groups cannot be dealt whole: unequal sizes, or a count that does not divide
    assert shard_rows(weights, 2, groups=[0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3]) == shard_rows(weights, 2)
    assert shard_rows(weights[:6], 2, groups=[1, 1, 2, 2, 3, 3]) == shard_rows(weights[:6], 2)
    # per mini-batch: each chunk of 6 is dealt on its own, a group to a rank
    chunked = shard_rows(weights, 2, chunk=6, groups=groups)
    assert [r // 6 for r in chunked[0]] == [0, 0, 0, 1, 1, 1]


def test_scatter_puts_rows_back_in_batch_order():
    # heaviest first: 5 (row 0) -> rank 0, 4 (row 2) -> rank 1, 2 (row 3) -> rank 1, 1 (row 1) -> rank 0
    plan = Scatter.plan([5, 1, 4, 2], 2)
    assert plan.shards == ((0, 1), (2, 3))
    per_rank = [torch.tensor([[float(r)] * 2 for r in rows]) for rows in plan.shards]
    gathered = plan.gather_rows(per_rank, width=3)
    assert gathered.tolist() == [[0, 0, 0], [1, 1, 0], [2, 2, 0], [3, 3, 0]]


def _batch(seed: int, rows: int = 5) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)

    def ids(low, high):
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(4, 90, (length,), generator=generator).tolist()

    rollouts = []
    for index in range(rows):
        response = ids(1, 7)
        rollouts.append(
            Rollout(ids(2, 9), response, [0.0] * len(response), [1] * len(response), "stop", index)
        )
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


def test_pack_lays_real_tokens_in_one_row_with_restarting_positions():
    input_ids = torch.tensor([[0, 0, 7, 8, 9, 0], [0, 5, 6, 4, 0, 0]])
    starts, lengths = mask_spans((input_ids != 0).long())
    assert starts.tolist() == [2, 1] and lengths.tolist() == [3, 3]
    packed = pack(input_ids, starts, lengths)
    assert packed.input_ids.tolist() == [[7, 8, 9, 5, 6, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert packed.cu_seq_lens.tolist() == [0, 3, 6] and packed.cu_seq_lens.dtype == torch.int32
    assert packed.max_length == 3
    with pytest.raises(ValueError, match="without real tokens"):
        pack(input_ids, torch.tensor([2, 0]), torch.tensor([3, 0]))


def test_a_batch_is_packed_and_its_responses_found_from_its_host_lengths():
    # the layout is planned from the lengths (no boolean mask on the device): it must be the one the
    # attention mask describes
    batch = _batch(seed=4)
    packed = pack_batch(batch)
    real = batch.attention_mask.bool()
    assert packed.input_ids[0].tolist() == batch.input_ids[real].tolist()
    assert packed.position_ids[0].tolist() == batch.position_ids[real].tolist()
    tokens = ResponseTokens.of(batch)
    response_mask = batch.attention_mask[:, batch.prompt_width :].bool()
    assert tokens.take(batch.responses).tolist() == batch.responses[response_mask].tolist()
    values = torch.arange(1.0, tokens.flat.numel() + 1, requires_grad=True)
    placed = tokens.place(values)
    assert placed[response_mask].tolist() == values.tolist() and placed[~response_mask].eq(0).all()
    placed.sum().backward()
    assert values.grad.eq(1).all()
    # lengths stay on the host when the batch moves: micro-batches are planned without the device
    assert batch.to("cpu").prompt_lengths is batch.prompt_lengths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=3
    )


def test_packed_forward_matches_the_padded_one(model_dir):
    model = load_policy(str(model_dir))
    backbone, _ = backbone_and_head(model)
    batch = _batch(seed=0)
    padded, tokens = response_hidden_states(backbone, batch, remove_padding=False)
    # the padded path's rows are the hidden states at P-1+t of each real response token t
    full = backbone(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).last_hidden_state
    response_mask = batch.attention_mask[:, batch.prompt_width :].bool()
    P, T = batch.prompt_width, batch.response_width
    torch.testing.assert_close(padded, full[:, P - 1 : P - 1 + T][response_mask])
    use_packed_attention(model)
    packed, packed_tokens = response_hidden_states(backbone, batch, remove_padding=True)
    assert torch.equal(tokens.flat, packed_tokens.flat) and packed.shape == padded.shape
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    # negative control: the packed row without sequence boundaries lets later sequences attend to earlier ones
    whole = backbone(input_ids=pack_batch(batch).input_ids, use_cache=False)
    assert not torch.allclose(whole.last_hidden_state[0, -3:], packed[-3:], atol=1e-3)


def _grouped_batch(seed: int, sizes=(3, 1, 2), prompt_length: int | None = None) -> TrainBatch:
    """GRPO's layout: each group's rows one prompt (of prompt_length tokens, or random lengths),
    responses of their own lengths."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low, high):
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(4, 90, (length,), generator=generator).tolist()

    rollouts = []
    for index, size in enumerate(sizes):
        prompt = ids(2, 9) if prompt_length is None else ids(prompt_length, prompt_length + 1)
        for _ in range(size):
            response = ids(1, 7)
            scores = [0.0] * len(response)
            rollouts.append(Rollout(prompt, response, scores, [1] * len(response), "stop", index))
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


def _logprobs_and_grads(model_dir, batch, *, share: bool):
    model = load_policy(str(model_dir))
    use_packed_attention(model, share_prompts=share)
    out = response_logprobs(model, batch, with_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    return out.logprobs, out.entropy, [p.grad for p in model.parameters() if p.grad is not None]


def test_a_groups_rows_share_one_pass_of_their_prompt_with_the_packed_logprobs_and_gradients(model_dir):
    batch = _grouped_batch(seed=1)
    packed, _ = pack_shared(batch)
    lengths = batch.prompt_lengths + batch.response_lengths
    # the layers see each group's prompt once (groups start at rows 0, 3 and 4) ...
    once = batch.prompt_lengths[[0, 3, 4]].sum() + batch.response_lengths.sum()
    assert packed.input_ids.shape[1] == int(once)
    # what perf/mfu/actor leaves out: rows 1, 2 and 5 ran no prompt of their own
    assert shared_prompt_tokens(batch) == int(batch.prompt_lengths[[1, 2, 5]].sum()) > 0
    # ... and attention every row's [prompt; response] as its keys, as unshared; its queries are its
    # tokens in the packed row
    assert packed.expand.numel() == int(lengths.sum())
    assert packed.key_cu_seq_lens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert packed.key_max_length == int(lengths.max())
    assert packed.input_ids[0, packed.expand].tolist() == pack_batch(batch).input_ids[0].tolist()
    queries = batch.response_lengths.clone()
    queries[[0, 3, 4]] += batch.prompt_lengths[[0, 3, 4]]
    assert packed.cu_seq_lens.tolist() == [0, *queries.cumsum(0).tolist()] == packed.offsets.tolist()
    unshared = _logprobs_and_grads(model_dir, batch, share=False)
    shared = _logprobs_and_grads(model_dir, batch, share=True)
    torch.testing.assert_close(shared[0], unshared[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], unshared[1], atol=1e-5, rtol=0)
    assert len(shared[2]) == len(unshared[2])
    for got, want in zip(shared[2], unshared[2]):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    # negative control: the packed row attended as it lies (each response seeing its siblings) differs
    model = load_policy(str(model_dir))
    use_packed_attention(model)
    backbone, _ = backbone_and_head(model)
    runs = torch.tensor([0, packed.input_ids.shape[1]], dtype=torch.int32)
    plain = backbone(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=packed.input_ids.new_empty((1, 1, 0, 0), dtype=torch.bool),
        cu_seq_lens_q=runs, cu_seq_lens_k=runs, max_length_q=packed.input_ids.shape[1],
        max_length_k=packed.input_ids.shape[1], use_cache=False,
    ).last_hidden_state[0]  # fmt: skip
    model.share_prompts = True
    with_shared = backbone(**packed.model_kwargs(), use_cache=False).last_hidden_state[0]
    assert not torch.allclose(plain[-3:], with_shared[-3:], atol=1e-3)


def test_rows_of_one_group_id_with_other_prompts_are_not_shared(model_dir):
    # a group id stands for one prompt; on the host the prompts are compared as well
    batch = _grouped_batch(seed=2, sizes=(2, 2), prompt_length=5)
    one_id = batch.with_fields(group_ids=torch.zeros(len(batch), dtype=torch.long))
    assert pack_shared(one_id)[0].input_ids.shape == pack_shared(batch)[0].input_ids.shape
    shared = _logprobs_and_grads(model_dir, one_id, share=True)
    unshared = _logprobs_and_grads(model_dir, batch, share=False)
    for got, want in zip(shared[:2], unshared[:2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _family_model(family: str):
    """A tiny randomly initialised model of each attention family the token-major forward covers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )  # fmt: skip
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),  # SmolLM2's architecture
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # per-head q/k norms before the rotation
    }[family]
    torch.manual_seed(5)
    return model_class(config_class(**shape)).eval()


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_token_major_packed_attention_matches_the_modules_own_forward(family):
    # use_packed_attention gives Llama/Qwen attention modules a forward that stays token-major (no
    # head-major transposes around the graph break of compiled layers); it must compute what the
    # module's own forward computes through the packed attention function, values and gradients.
    from trainer.packing import token_major_attention

    batch = _batch(seed=1)
    results = {}
    for variant in ("own", "token_major"):
        model = _family_model(family)
        backbone, _ = backbone_and_head(model)
        use_packed_attention(model)
        attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        assert attention and all(m.forward.__func__ is token_major_attention for m in attention)
        if variant == "own":
            for module in attention:
                del module.forward
        hidden, _ = response_hidden_states(backbone, batch, remove_padding=True)
        hidden.square().mean().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results[variant] = hidden.detach(), grads
    (own, own_grads), (token_major, token_major_grads) = results["own"], results["token_major"]
    torch.testing.assert_close(token_major, own, atol=1e-5, rtol=1e-5)
    assert (
        own_grads.keys() == token_major_grads.keys() and "model.layers.0.self_attn.q_proj.weight" in own_grads
    )
    for name, expected in own_grads.items():
        torch.testing.assert_close(token_major_grads[name], expected, atol=1e-5, rtol=1e-4, msg=name)
    # and the padded forward with a KV cache (the hf rollout's decoding) still takes the module's own path
    model = _family_model(family)
    use_packed_attention(model)
    prompt = torch.tensor([[5, 6, 7, 8]])
    greedy = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    reference = _family_model(family).generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, reference)


def test_sharded_checkpoint_round_trip_in_one_process(model_dir, tmp_path):
    model = load_policy(str(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    save_sharded(tmp_path / "actor", model, optimizer)

    fresh = load_policy(str(model_dir))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_sharded(tmp_path / "actor", fresh, fresh_optimizer)
    for (name, expected), actual in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(expected, actual), name
    first = next(iter(optimizer.state.values()))
    assert torch.equal(first["exp_avg"], next(iter(fresh_optimizer.state.values()))["exp_avg"])
    full = load_full_model_state(tmp_path / "actor")
    assert set(full) == set(model.state_dict())  # tied names included, as the model's own state dict
    assert torch.equal(full["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_weight_stream_yields_every_tensor_once_gathered_in_buckets(model_dir):
    model = load_policy(str(model_dir))
    named = list(iter_full_state(model, torch.bfloat16))
    assert [name for name, _ in named] == list(model.state_dict())
    by_name = dict(named)
    assert all(t.dtype == torch.bfloat16 for t in by_name.values())
    assert by_name["lm_head.weight"] is by_name["model.embed_tokens.weight"]  # tied: gathered once
    sizes = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets(iter(named), 8192)]
    largest = max(t.numel() * t.element_size() for _, t in named)
    assert all(size <= max(8192, largest) for size in sizes) and len(sizes) > 1
    assert SINGLE_PROCESS.sum_floats(1.5, 2.0) == [1.5, 2.0]


def test_the_weight_sync_gathers_a_sharded_model_group_by_group_with_the_same_tensors(model_dir):
    """iter_gathered (FSDP2's unshard, one collective a unit: here the one unit of a one-rank model; the
    2-rank tests in test_distributed.py gather a layer at a time) yields what iter_full_state (one
    collective a tensor) does, tied names included, and leaves the model sharded."""
    from trainer.parallel.distributed import local_data_parallel
    from trainer.parallel.fsdp import FSDPSettings, iter_gathered, shard_model

    cpu = torch.device("cpu")
    model = shard_model(load_policy(str(model_dir)), local_data_parallel(cpu), FSDPSettings(), cpu)
    expected = dict(iter_full_state(model, torch.bfloat16))
    gathered = list(iter_gathered(model, torch.bfloat16))
    assert sorted(name for name, _ in gathered) == sorted(expected)
    for name, tensor in gathered:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    by_name = dict(gathered)
    assert by_name["lm_head.weight"] is by_name["model.embed_tokens.weight"]  # tied: gathered once
    assert all(hasattr(p, "full_tensor") for p in model.parameters())  # every group resharded
    with torch.no_grad():  # an optimizer step's worth of change: the next sync has the new values
        for parameter in model.parameters():
            parameter.add_(1.0)
    again = dict(iter_gathered(model, torch.bfloat16))  # the walk is planned once a model, values not
    for name, tensor in dict(iter_full_state(model, torch.bfloat16)).items():
        assert torch.equal(again[name], tensor) and not torch.equal(tensor, expected[name]), name


def test_consecutive_layers_share_a_unit_and_the_weight_sync_gathers_each_unit_once(tmp_path, monkeypatch):
    """fsdp_config.layers_per_unit: 3 decoder layers in units of 2 are two FSDP units (one state each:
    [0, 1] and [2]) besides the root, and iter_gathered unshards each unit once, with every tensor."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from trainer.parallel.distributed import local_data_parallel
    from trainer.parallel.fsdp import FSDPSettings, iter_gathered, shard_model

    cpu = torch.device("cpu")
    path = make_tiny_model(tmp_path / "m", hidden=32, layers=3, heads=4, kv_heads=2, seed=3)
    settings = FSDPSettings(offload_policy=True, layers_per_unit=2)  # units on one rank: CPU offload
    model = shard_model(load_policy(str(path)), local_data_parallel(cpu), settings, cpu)
    layers = model.model.layers
    assert fully_shard.state(layers[0]) is fully_shard.state(layers[1]) is not fully_shard.state(layers[2])
    assert len({id(fully_shard.state(m)) for m in model.modules() if isinstance(m, FSDPModule)}) == 3
    unshards = []
    original = FSDPModule.unshard

    def counted(module, *args, **kwargs):
        unshards.append(id(fully_shard.state(module)))
        return original(module, *args, **kwargs)

    monkeypatch.setattr(FSDPModule, "unshard", counted)  # counts, then gathers as FSDP2 does
    gathered = list(iter_gathered(model, torch.bfloat16))
    monkeypatch.undo()
    assert len(unshards) == len(set(unshards)) == 3  # the root and the two units, once each
    expected = dict(iter_full_state(model, torch.bfloat16))
    assert sorted(name for name, _ in gathered) == sorted(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in gathered)


def test_one_rank_shards_the_model_as_one_unit_and_a_pass_without_gradients_frees_its_gathered_copy(
    model_dir,
):
    # units a layer only cost host time on one rank (no one to gather from); CPU offload keeps them
    from trainer.parallel.distributed import local_data_parallel
    from trainer.parallel.fsdp import FSDPSettings, is_sharded, shard_model
    from trainer.workers.logprobs import LogprobHead, batched_response_logprobs

    cpu = torch.device("cpu")
    model = shard_model(load_policy(str(model_dir)), local_data_parallel(cpu), FSDPSettings(), cpu)
    assert [name for name, module in model.named_modules() if is_sharded(module)] == [""]
    offloaded = shard_model(
        load_policy(str(model_dir)), local_data_parallel(cpu), FSDPSettings(offload_policy=True), cpu
    )
    assert sum(is_sharded(module) for module in offloaded.modules()) == 1 + 2  # the root and 2 layers

    def gathered() -> bool:  # FSDP2 swaps in plain tensors while unsharded, DTensor shards after
        return not all(hasattr(p, "full_tensor") for p in model.parameters())

    batch = _batch(seed=5)
    model.unshard()
    assert gathered()
    out = batched_response_logprobs(
        model, batch, 2, temperature=1.0, with_entropy=False, autocast_dtype=None, head=LogprobHead()
    )
    assert not gathered()  # the root would keep it (reshard_after_forward=False) for a backward
    assert out.logprobs.shape == batch.response_mask.shape and out.logprobs.isfinite().all()


def test_flash_attention_dtype_under_autocast():
    # Under bf16 autocast the rotary embedding leaves q and k in fp32 beside a bf16 v; flash attention
    # takes half precision only, so the packed path casts to autocast's dtype (as SDPA would run) rather
    # than falling back to one attention call per sequence (3x slower steps on an H100).
    from trainer.packing import flash_dtype

    fp32, bf16, fp16 = (torch.zeros(2, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert flash_dtype(fp32, fp32, bf16, torch.bfloat16) == torch.bfloat16
    assert flash_dtype(bf16, bf16, bf16, None) == torch.bfloat16
    assert flash_dtype(fp16, fp16, fp16, torch.bfloat16) == torch.float16
    assert flash_dtype(fp32, fp32, fp32, None) is None  # full precision, no autocast: exact, per sequence
    assert flash_dtype(fp32, fp32, fp32, torch.float32) is None


@pytest.mark.gpu
def test_flash_attention_takes_grouped_kv_heads_and_gives_the_gradients_of_attention_per_sequence():
    # GQA: 14 query heads over 2 key/value heads (Qwen2.5-0.5B's ratio), the keys and values not repeated
    from trainer import packing

    gen = torch.Generator().manual_seed(0)
    lengths = [37, 1, 120, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n = sum(lengths)
    leaves = [
        (torch.randn(n, heads, 64, generator=gen) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
        for heads in (14, 2, 2)
    ]
    longest = max(lengths)
    packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    flash = packing.varlen_causal_attention(*leaves, packed, scale=0.125)
    assert "varlen" not in packing._DISABLED
    exact = packing._attention_per_sequence(*leaves, cu, cu, scale=0.125)
    torch.testing.assert_close(flash.float(), exact.float(), atol=2e-2, rtol=2e-2)
    grad_out = torch.randn(flash.shape, generator=gen).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(flash, leaves, grad_out)
    expected = torch.autograd.grad(exact, leaves, grad_out)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_flash_attention_with_fewer_queries_than_keys_ends_the_causal_mask_at_the_keys_end():
    # shared prompts' layout: a sequence's queries are the last of its keys (its response), and
    # flash attention must align the causal mask to the keys' end as the per-sequence path does
    from trainer import packing

    gen = torch.Generator().manual_seed(1)
    queries, keys = [5, 40, 1, 33], [5, 60, 9, 50]  # one sequence whole, three with a prompt before

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    leaves = [
        (torch.randn(n, heads, 64, generator=gen) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
        for n, heads in ((sum(queries), 14), (sum(keys), 2), (sum(keys), 2))
    ]
    packed = {
        "cu_seq_lens_q": cu(queries), "cu_seq_lens_k": cu(keys),
        "max_length_q": max(queries), "max_length_k": max(keys),
    }  # fmt: skip
    flash = packing.varlen_causal_attention(*leaves, packed, scale=0.125)
    assert "varlen" not in packing._DISABLED
    exact = packing._attention_per_sequence(*leaves, cu(queries), cu(keys), scale=0.125)
    torch.testing.assert_close(flash.float(), exact.float(), atol=2e-2, rtol=2e-2)
    grad_out = torch.randn(flash.shape, generator=gen).to("cuda", torch.bfloat16)
    for got, want in zip(
        torch.autograd.grad(flash, leaves, grad_out), torch.autograd.grad(exact, leaves, grad_out)
    ):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_packed_forward_under_autocast_runs_flash_on_cuda(model_dir):
    # One-process runs keep fp32 weights under bf16 autocast: the packed forward must stay on flash
    # attention (no fallback to a call per sequence) and agree with the padded forward at bf16 precision.
    from trainer import packing

    model = load_policy(str(model_dir)).cuda()
    backbone, _ = backbone_and_head(model)
    batch = _batch(seed=0).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        padded, _ = response_hidden_states(backbone, batch, remove_padding=False)
        use_packed_attention(model)
        packed, _ = response_hidden_states(backbone, batch, remove_padding=True)
    assert "varlen" not in packing._DISABLED
    torch.testing.assert_close(packed.float(), padded.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_shared_prompts_run_flash_on_cuda_and_match_the_unshared_packed_forward(model_dir):
    from trainer import packing

    batch = _grouped_batch(seed=1, sizes=(4, 1, 3)).to("cuda")
    results = []
    for share in (False, True):
        model = load_policy(str(model_dir)).cuda()
        use_packed_attention(model, share_prompts=share)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = response_logprobs(model, batch, with_entropy=True)
        out.logprobs.sum().backward()
        results.append((out.logprobs, [p.grad.float() for p in model.parameters() if p.grad is not None]))
    assert "varlen" not in packing._DISABLED
    torch.testing.assert_close(results[1][0], results[0][0], atol=3e-2, rtol=3e-2)
    for got, want in zip(results[1][1], results[0][1]):
        assert (got - want).norm() <= 3e-2 * want.norm() + 1e-6


def test_policy_ranks_use_data_tokenizer_for_their_engine_and_checkpoints(model_dir, tmp_path):
    """data.tokenizer (verl's key): a tokenizer other than the model folder's. The driver loads it
    (trainer/build.py); the policy rank built from the same config must too, for its engine's eos ids
    and for the tokenizer its checkpoint saves. It read the model folder's before."""
    from testing.tiny import END_OF_TEXT, UNKNOWN, char_tokenizer
    from trainer.checkpoint import HF_METADATA_DIR
    from trainer.config import load_config
    from trainer.model import default_precision, load_tokenizer
    from trainer.parallel.distributed import local_data_parallel
    from trainer.parallel.ranks import PolicyRank
    from trainer.parallel.settings import policy_rank_settings

    # the model folder's tokenizer: eos <|im_end|> (id 2), pad <|endoftext|> (id 0); data.tokenizer's:
    # the same vocabulary with eos <|endoftext|> (0) and pad <|unk|> (3)
    other = char_tokenizer()
    other.eos_token, other.pad_token = END_OF_TEXT, UNKNOWN
    other.save_pretrained(tmp_path / "tokenizer")
    model_tokenizer = load_tokenizer(str(model_dir))
    assert (model_tokenizer.eos_token_id, model_tokenizer.pad_token_id) == (2, 0)
    config = load_config(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.tokenizer={tmp_path / 'tokenizer'}",
            "actor_rollout_ref.rollout.name=builtin",
        ],
        check=False,
    )
    cpu = torch.device("cpu")
    settings = policy_rank_settings(config, default_precision(cpu), steps=1)
    rank = PolicyRank(settings, local_data_parallel(cpu), cpu)
    try:
        assert (rank.replica.tokenizer.eos_token_id, rank.replica.tokenizer.pad_token_id) == (0, 3)
        # the engine stops on data.tokenizer's eos, and on the eos the model's generation config names
        assert rank.replica.engine.eos_token_ids == frozenset({0, 2})
        rank.save(str(tmp_path / "actor"), contents=("model",))
    finally:
        rank.close()
    saved = load_tokenizer(str(tmp_path / "actor" / HF_METADATA_DIR))
    assert (saved.eos_token, saved.pad_token) == (END_OF_TEXT, UNKNOWN)
