"""The distributed trainer on a real Ray cluster of two simulated nodes (ray.cluster_utils.Cluster), with
FSDP2 over gloo on CPU, and a tiny random Qwen2.

One cluster serves the module: a head that runs no workers and two nodes of one CPU each, so a 2-rank
group always spans both nodes. Groups are expensive to start (a process per rank that imports torch and
loads the model), so each test builds only the groups it needs and shuts them down.

Tolerances: fp32 on CPU. Gradients summed over 2 ranks equal one process's to float rounding (1e-5
relative); AdamW's first steps divide by sqrt(v) ~ |g|, which magnifies rounding in near-zero
gradients, so parameters are compared through the model's logprobs on a probe batch (atol 1e-4).
"""

import asyncio
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from testing.tiny import make_tiny_model
from trainer.batch import TrainBatch
from trainer.checkpoint import LocalRole
from trainer.parallel.distributed import shard_rows
from trainer.parallel.fsdp import FSDPSettings
from trainer.model import load_policy
from trainer.rollout.base import Rollout, SamplingParams
from trainer.workers.policy import Policy, PolicyLossSettings
from trainer.workers.common import (
    OptimizerSettings,
    TokenBudget,
    UpdateSettings,
    budget_units,
    token_budget_bounds,
)
from trainer.parallel.groups import PolicyGroup
from trainer.parallel.placement import RayRanks, ResourcePool, connect_ray
from trainer.parallel.ranks import EngineSettings, ModelSettings, PolicyRank, PolicyRankSettings

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]

VOCAB = 100
MINI_BATCH, MICRO_BATCH = 4, 1  # 8 rows = 2 optimizer steps; each rank: 2 rows per step, 2 micro-batches


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    connect_ray(cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=3
    )


def optim():
    return OptimizerSettings(
        lr=1e-3,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        warmup_steps=0,
        total_steps=10,
        schedule="constant",
        min_lr_ratio=0.0,
    )


def loss_settings(mode: str, entropy: float = 0.01, skip: bool = False) -> PolicyLossSettings:
    return PolicyLossSettings(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        entropy_coeff=entropy,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="low_var_kl",
        skip_zero_advantage_rows=skip,
    )


def policy_settings(
    model_dir,
    mode="token-mean",
    engine=None,
    remove_padding=True,
    budget=None,
    context=64,
    entropy=0.01,
    skip=False,
    layers_per_unit=1,
    share=False,
    micro_batch=MICRO_BATCH,
) -> PolicyRankSettings:
    """engine: the colocated engine's name (builtin, hf), None for none; budget: use_dynamic_bsz's
    tokens per micro-batch (update and logprobs), None for sequence counts; entropy, skip: the loss's
    entropy_coeff and skip_zero_advantage_rows; share: model.share_prompts."""
    tokens = TokenBudget(budget) if budget else None
    return PolicyRankSettings(
        model=ModelSettings(
            path=str(model_dir),
            remove_padding=remove_padding,
            share_prompts=share,
            fsdp=FSDPSettings(layers_per_unit=layers_per_unit),
        ),
        optim=optim(),
        update=UpdateSettings(mini_batch_size=MINI_BATCH, micro_batch_size=micro_batch, token_budget=tokens),
        loss=loss_settings(mode, entropy, skip),
        log_prob_micro_batch_size=tokens or 2,
        engine=EngineSettings(name=engine, context_length=context) if engine else None,
    )


def policy_group(model_dir, nnodes: int, **settings) -> PolicyGroup:
    import functools

    pool = ResourcePool(nnodes, 1, use_gpu=False)
    build = functools.partial(PolicyRank, policy_settings(model_dir, **settings))
    ranks = RayRanks(pool, build, role="policy", seed=0)
    whole = settings.get("share", False)
    return PolicyGroup(ranks, mini_batch_size=MINI_BATCH, whole_groups=whole), pool


def close(group, pool):
    group.shutdown()
    pool.release()


def process_ends(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def make_batch(seed: int, rows: int = 8, same_prompts: bool = False) -> TrainBatch:
    """Prompts and responses of different lengths (so ranks get different token counts), one masked token
    inside some responses, old logprobs off-policy by a little and +-advantages. Rows 2k and 2k+1 are one
    group (prompt index k); same_prompts: with one prompt, as GRPO's samples are."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for index in range(rows):
        prompt_len, response_len = (
            int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((2, 8), (1, 9))
        )
        if same_prompts and index % 2:
            prompt_len = len(rollouts[-1].prompt_ids)
        loss_mask = [1] * response_len
        if response_len > 3:
            loss_mask[1] = 0
        rollouts.append(
            Rollout(
                prompt_ids=rollouts[-1].prompt_ids
                if same_prompts and index % 2
                else torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist(),
                response_ids=torch.randint(3, VOCAB, (response_len,), generator=gen).tolist(),
                logprobs=[0.0] * response_len,
                loss_mask=loss_mask,
                finish_reason="length",
                prompt_index=index // 2,
            )
        )
    batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
    noise = 0.3 * torch.randn(batch.response_mask.shape, generator=gen)
    advantages = torch.randn(len(batch), 1, generator=gen).expand_as(noise) * batch.response_mask
    return batch.with_fields(old_logprobs=(-2.0 + noise) * batch.response_mask, advantages=advantages)


def local_policy(model_dir, mode: str, checkpoint=None, budget=None, **loss) -> Policy:
    settings = policy_settings(model_dir, mode, budget=budget, **loss)
    policy = Policy(
        load_policy(str(model_dir)),
        settings.optim,
        settings.update,
        settings.loss,
        log_prob_micro_batch_size=settings.log_prob_micro_batch_size,
    )
    if checkpoint is not None:
        LocalRole(policy.model, policy.optimizer, policy.scheduler).load(str(checkpoint))
    return policy


def assert_same_metrics(distributed: dict, single: dict) -> None:
    assert distributed.keys() == single.keys()
    for name, value in single.items():
        assert distributed[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize(
    ("mode", "layers_per_unit"), [("token-mean", 1), ("seq-mean-token-mean", 1), ("token-mean", 2)]
)
def test_two_ranks_on_two_nodes_give_the_update_of_one_process_and_resume_on_one(
    cluster, model_dir, tmp_path, mode, layers_per_unit
):
    # layers_per_unit 2: the model's two decoder layers one FSDP unit (a list of modules, one state)
    group, pool = policy_group(model_dir, nnodes=2, mode=mode, layers_per_unit=layers_per_unit)
    try:
        assert len(set(group.node_ids())) == 2  # one rank on each simulated node
        group.save(str(tmp_path / "start"))  # the single process starts from the very same state
        single = local_policy(model_dir, mode, checkpoint=tmp_path / "start")
        probe = make_batch(seed=7)
        for step, batch in enumerate((make_batch(seed=1), make_batch(seed=2))):
            if step == 1:  # saved on 2 ranks with AdamW moments and a stepped schedule, resumed on 1
                group.save(str(tmp_path / "after"))
                single = local_policy(model_dir, mode, checkpoint=tmp_path / "after")
            metrics, expected = group.update(batch), single.update(batch)
            assert_same_metrics(metrics, expected)
            assert metrics["actor/grad_norm"] > 0
            after = group.compute_logprobs(probe, with_entropy=True)
            reference = single.compute_logprobs(probe, with_entropy=True)
            torch.testing.assert_close(after.logprobs, reference.logprobs, atol=1e-4, rtol=0)
            torch.testing.assert_close(after.entropy, reference.entropy, atol=1e-4, rtol=0)
        # the group reads its own checkpoint back: rewound to after step 1, step 2 repeats exactly
        group.load(str(tmp_path / "after"))
        assert_same_metrics(group.update(make_batch(seed=2)), metrics)
    finally:
        close(group, pool)


def test_token_budget_micro_batches_on_two_ranks_give_the_update_of_one_process(cluster, model_dir, tmp_path):
    # use_dynamic_bsz under FSDP: a rank whose rows fit fewer micro-batches runs as many as the rank
    # that needs the most (every sharded forward is a collective); the update is still one process's
    budget = 14  # rows of 3-15 tokens: a rank needs 1 or 2 micro-batches for its 2 rows of a mini-batch
    uneven = 0  # mini-batches where the two ranks' own cuts differ (so one must re-cut to match)
    for seed in (1, 2, 3):
        batch = make_batch(seed=seed)
        tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
        shards, half = shard_rows(tokens, 2, MINI_BATCH), MINI_BATCH // 2
        for k in range(0, len(shards[0]), half):
            cuts = {len(token_budget_bounds([tokens[i] for i in s[k : k + half]], budget)) for s in shards}
            uneven += len(cuts) > 1
    assert uneven > 0
    group, pool = policy_group(model_dir, nnodes=2, budget=budget)
    try:
        group.save(str(tmp_path / "start"))
        single = local_policy(model_dir, "token-mean", checkpoint=tmp_path / "start", budget=budget)
        for seed in (1, 2, 3):
            batch = make_batch(seed=seed)
            assert_same_metrics(group.update(batch), single.update(batch))
        probe = make_batch(seed=7)
        torch.testing.assert_close(
            group.compute_logprobs(probe).logprobs, single.compute_logprobs(probe).logprobs, atol=1e-4, rtol=0
        )
    finally:
        close(group, pool)


@pytest.mark.parametrize("budget", [None, 14])
def test_two_ranks_sharing_prompts_get_whole_groups_and_give_the_update_of_one_process(
    cluster, model_dir, tmp_path, budget
):
    """model.share_prompts: a prompt's group goes to one rank, whose micro-batch of 2 runs its prompt
    once. With a token budget of 14 a rank's group of 3-26 tokens is one micro-batch or (over the budget)
    two, and a rank with one group that fits runs two to match the other: cut by rows."""
    group, pool = policy_group(model_dir, nnodes=2, share=True, micro_batch=2, budget=budget)
    matched_by_rows = 0
    try:
        group.save(str(tmp_path / "start"))
        single = local_policy(
            model_dir, "token-mean", checkpoint=tmp_path / "start", micro_batch=2, budget=budget
        )
        for seed in (1, 2):
            batch = make_batch(seed=seed, same_prompts=True)
            plan, _ = group.scatter(batch, MINI_BATCH)
            for rows in plan.shards:  # each mini-batch's part: one whole group (rows 2k, 2k+1)
                assert all(rows[i] // 2 == rows[i + 1] // 2 for i in range(0, len(rows), 2))
            if budget:  # a mini-batch where one rank's group fits and the other's does not
                half = MINI_BATCH // 2
                for k in range(0, len(plan.shards[0]), half):
                    parts = [batch.select(rows[k : k + half]) for rows in plan.shards]
                    matched_by_rows += len({len(budget_units(p, budget, True)[0]) for p in parts}) > 1
            assert_same_metrics(group.update(batch), single.update(batch))
    finally:
        close(group, pool)
    assert not budget or matched_by_rows


def test_two_ranks_skipping_zero_advantage_rows_give_the_full_update_of_one_process(
    cluster, model_dir, tmp_path
):
    """In the first mini-batch only rank 0's two rows have signal: rank 1 trains two rows without (each
    micro-batch's forward and backward are collectives); none of the second has: each rank trains one
    row, and AdamW steps as the full update's. Against one process that trains every row."""
    group, pool = policy_group(model_dir, nnodes=2, entropy=0.0, skip=True)
    try:
        group.save(str(tmp_path / "start"))
        full = local_policy(model_dir, "token-mean", checkpoint=tmp_path / "start", entropy=0.0)
        batch = make_batch(seed=3)
        tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
        rank_0_first = shard_rows(tokens, 2, MINI_BATCH)[0][: MINI_BATCH // 2]  # its rows of rows 0-3
        advantages = torch.zeros_like(batch.advantages)
        advantages[rank_0_first] = batch.advantages[rank_0_first]
        batch = batch.with_fields(advantages=advantages)
        skipped, expected = group.update(batch), full.update(batch)
        for name in ("actor/pg_loss", "actor/grad_norm"):
            assert skipped[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        assert expected["actor/grad_norm"] > 0
        probe = make_batch(seed=7)
        torch.testing.assert_close(
            group.compute_logprobs(probe).logprobs, full.compute_logprobs(probe).logprobs, atol=1e-4, rtol=0
        )
    finally:
        close(group, pool)


def test_two_critic_ranks_give_the_value_update_of_one_process(cluster, model_dir, tmp_path):
    import functools

    from trainer.model import load_critic
    from trainer.workers.critic import Critic, ValueLossSettings
    from trainer.parallel.groups import CriticGroup
    from trainer.parallel.ranks import CriticRank, CriticRankSettings

    settings = CriticRankSettings(
        # the ranks also recompute activations in backward (gradient checkpointing under FSDP2)
        model=ModelSettings(path=str(model_dir), remove_padding=True, gradient_checkpointing=True),
        optim=optim(),
        update=UpdateSettings(mini_batch_size=MINI_BATCH, micro_batch_size=MICRO_BATCH),
        loss=ValueLossSettings(cliprange_value=0.5, loss_agg_mode="token-mean"),
        forward_micro_batch_size=2,
    )
    pool = ResourcePool(2, 1, use_gpu=False)
    ranks = RayRanks(pool, functools.partial(CriticRank, settings), role="critic", seed=0)
    group = CriticGroup(ranks, mini_batch_size=MINI_BATCH)
    try:
        group.save(str(tmp_path / "start"))
        single = Critic(load_critic(str(model_dir)), settings.optim, settings.update, settings.loss)
        LocalRole(single.model, single.optimizer, single.scheduler).load(str(tmp_path / "start"))
        batch = make_batch(seed=3)
        values = group.compute_values(batch)
        torch.testing.assert_close(values, single.compute_values(batch), atol=1e-5, rtol=0)
        returns = values + torch.randn(values.shape, generator=torch.Generator().manual_seed(4))
        batch = batch.with_fields(values=values, returns=returns * batch.response_mask)
        assert_same_metrics(group.update(batch), single.update(batch))
        probe = make_batch(seed=7)
        torch.testing.assert_close(
            group.compute_values(probe), single.compute_values(probe), atol=1e-4, rtol=0
        )
    finally:
        close(group, pool)


@pytest.mark.parametrize("name", ["builtin", "hf"])
def test_colocated_engines_generate_and_take_the_updated_weights(cluster, model_dir, name):
    """Each rank's engine (the built-in one: its own forward and KV cache, synced bucket by bucket) samples
    the tokens whose logprobs the FSDP policy gives, before and after a weight sync."""
    from trainer.rollout.manager import RolloutManager
    from trainer.rollout.pool import ReplicaPool

    group, pool = policy_group(model_dir, nnodes=2, engine=name, context=2048)
    engine = RolloutManager(ReplicaPool(group.replicas()))
    asyncio.run(engine.resume_memory_async(("kv_cache",)))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, n=2)

    def generated_vs_policy(rollouts):
        batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
        return batch.rollout_logprobs, group.compute_logprobs(batch).logprobs

    try:
        rollouts = engine.generate(prompts, greedy)
        assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
        assert all(m.served > 0 for m in engine.pool.members)  # both ranks' engines served prompts
        # each rank's prompts reached it in one call, not one call each (they would start spread out)
        assert [m.replica.batches for m in engine.pool.members] == [1, 1]
        assert [r.prompt_ids.tolist() for r in rollouts[::2]] == prompts
        engine_logprobs, policy_logprobs = generated_vs_policy(rollouts)
        torch.testing.assert_close(engine_logprobs, policy_logprobs, atol=1e-4, rtol=0)

        for seed in (1, 2):
            group.update(make_batch(seed=seed))
        stale, updated = generated_vs_policy(engine.generate(prompts, greedy))
        assert (stale - updated).abs().max() > 1e-3  # the engines still sample from the old weights

        assert group.sync_weights() > 0
        synced, updated = generated_vs_policy(engine.generate(prompts, greedy))
        torch.testing.assert_close(synced, updated, atol=1e-4, rtol=0)
        # sampled (temperature 1, top-k): still the policy's distribution, and the same again after a sync
        sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, n=4)
        engine_logprobs, policy_logprobs = generated_vs_policy(engine.generate(prompts, sampled))
        torch.testing.assert_close(engine_logprobs, policy_logprobs, atol=1e-4, rtol=0)

        # a request its caller cancels stops on the rank too (as after a failed round): the engines can
        # then release their KV caches, which they refuse while a request runs
        async def cancel_then_release():
            long = SamplingParams(max_new_tokens=2000, ignore_eos=True)
            request = asyncio.ensure_future(engine.generate_async([prompts[0]], long))
            await asyncio.sleep(0.5)
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            await engine.release_memory_async(("kv_cache",))
            return request.cancelled()

        assert asyncio.run(cancel_then_release())
    finally:
        engine.close()
        close(group, pool)


def test_rollout_servers_take_the_policy_from_a_checkpoint_rank_0_writes(cluster, model_dir):
    """rollout.name=sglang in a Ray run: no engine in the ranks; servers speaking SGLang's HTTP API (the
    built-in server here) generate, and load every new policy from the folder rank 0 writes."""
    from tests.helpers import service_process
    from trainer.rollout.manager import http_manager
    from trainer.parallel.groups import GroupWeights

    group, pool = policy_group(model_dir, nnodes=2)
    args = ("--model", str(model_dir), "--device", "cpu", "--context-length", "64")
    try:
        with service_process("trainer.rollout.server", *args) as (url, _):
            manager = http_manager([url])
            prompts, greedy = [[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_new_tokens=5)
            try:
                for seed in (1, 2):
                    group.update(make_batch(seed=seed))
                manager.load_weights(GroupWeights(group))
                batch = TrainBatch.from_rollouts(manager.generate(prompts, greedy), pad_id=0)
                policy_logprobs = group.compute_logprobs(batch).logprobs
                torch.testing.assert_close(batch.rollout_logprobs, policy_logprobs, atol=1e-4, rtol=0)
            finally:
                manager.close()
    finally:
        close(group, pool)


# ------------------------------------------------------------------------------ the fit loop

KILLER = """
import os

CALLS = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # scored in the driver, once per response: the first response of step {kill_step} kills a policy rank
    global CALLS
    CALLS += 1
    if CALLS == {per_step} * ({kill_step} - 1) + 1:
        os.kill(int(open({pid_file!r}).read()), 9)
    return 0.0
"""


def fit_args(model_dir, data_dir, workdir, *, steps: int, ranks: int) -> list[str]:
    return [
        "algorithm.adv_estimator=reinforce_plus_plus",
        f"data.train_files={data_dir / 'train.parquet'}",
        "data.train_batch_size=8",
        "data.max_prompt_length=160",
        "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.do_sample=false",  # greedy: the same rollouts on 2 ranks or 1 process
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        f"trainer.nnodes={ranks}",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.log_dir={workdir / 'run'}",
    ]


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import gsm8k_row

    folder = tmp_path_factory.mktemp("gsm8k")
    rows = [gsm8k_row(f"Question {i}: what is {i} + 3?", f"#### {i + 3}", "train", i) for i in range(32)]
    write_verl_parquet(rows, folder / "train.parquet")
    return folder


def logged_steps(workdir) -> dict[int, dict]:
    import json

    lines = (workdir / "run" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "actor/grad_norm" in m}


def test_fit_on_two_ranks_dies_cleanly_and_resumes_on_one_process(cluster, model_dir, gsm8k_files, tmp_path):
    import asyncio

    from trainer.config import load_config
    from trainer.loop import TrainingAborted, _fit, train
    from trainer.build import build_run, close_run

    ranks_dir, single_dir = tmp_path / "ranks", tmp_path / "single"
    pid_file = tmp_path / "pid"
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER.format(kill_step=3, per_step=8, pid_file=str(pid_file)))
    cfg = load_config(
        fit_args(model_dir, gsm8k_files, ranks_dir, steps=3, ranks=2)
        + [f"custom_reward_function.path={killer}", "reward_model.mode=local"]
    )

    pids = []

    async def train_until_killed():
        run = await build_run(cfg)
        try:
            assert run.world_size == 2 and run.policy.remote
            pids.extend(run.policy.ranks.pids)
            assert run.reference.ranks.pids == pids  # colocated roles: one process a rank
            pid_file.write_text(str(pids[1]))
            await train(run)
        finally:
            await close_run(run)

    # rank 1's process (its policy and reference ranks) is killed while step 3 scores its responses: the
    # step fails in the next call to it, the reference's; rank 0 (blocked in a collective with the dead
    # rank) is shut down instead of hanging
    with pytest.raises(
        TrainingAborted, match=r"reference rank 1 of 2 failed.*last usable checkpoint: .*global_step_2"
    ):
        asyncio.run(train_until_killed())
    assert process_ends(pids[0], within_s=120)

    # resume step 1's checkpoint (written by 2 ranks) in one process without Ray: step 2 comes out the same
    # (the same reward function: it scores 0 and kills nothing before step 3)
    single = load_config(
        fit_args(model_dir, gsm8k_files, single_dir, steps=2, ranks=1)
        + [
            f"custom_reward_function.path={killer}",
            "reward_model.mode=local",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={ranks_dir / 'ckpt' / 'global_step_1'}",
        ]
    )
    asyncio.run(_fit(single))
    on_ranks, on_one = logged_steps(ranks_dir)[2], logged_steps(single_dir)[2]
    for name in (
        "actor/grad_norm",
        "actor/kl_loss",
        "actor/entropy",
        "actor/pg_loss",
        "response_length/mean",
    ):
        assert on_one[name] == pytest.approx(on_ranks[name], rel=1e-4, abs=1e-6), name
    assert "timing_s/update_weights" in on_ranks and on_ranks["perf/throughput"] > 0


def test_fit_on_two_ranks_generates_with_their_builtin_engines(cluster, model_dir, gsm8k_files, tmp_path):
    """The loop on 2 ranks with rollout.name=builtin: each rank's engine samples, is synced after every
    update, and its logprobs stay those of the policy (the gap verl logs, fp32 on CPU)."""
    import asyncio

    from trainer.config import load_config
    from trainer.loop import _fit

    cfg = load_config(
        fit_args(model_dir, gsm8k_files, tmp_path, steps=2, ranks=2)
        + ["reward_model.mode=local", "trainer.save_freq=-1", "actor_rollout_ref.rollout.name=builtin"]
        + ["trainer.profile_steps=[2]"]  # and the profiler reaching into the ranks
    )
    assert cfg.actor_rollout_ref.rollout.engine == "builtin"
    asyncio.run(_fit(cfg))
    steps = logged_steps(tmp_path)
    assert sorted(steps) == [1, 2]
    profiles = tmp_path / "run" / "profile"
    # one trace a rank process, named after its first role: the reference's rank lives in the policy's
    expected = {"step_2"} | {f"step_2_policy_rank{r}" for r in (0, 1)}
    assert {p.name.removesuffix(".txt") for p in profiles.glob("*.txt")} == expected
    assert {p.name.removesuffix(".json") for p in profiles.glob("*.json")} == expected
    # a policy rank's table holds its update: the backward ran inside the profiled step
    assert "backward" in (profiles / "step_2_policy_rank1.txt").read_text().lower()
    # each phase of a rank is a named range of its trace, which bench/trace_summary.py splits the step by
    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "bench" / "trace_summary.py")
    trace_summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_summary)
    rows = {row["phase"]: row for row in trace_summary.summarize(profiles / "step_2_policy_rank1.json")}
    assert {"rank.update", "rank.sync_weights"} <= set(rows)
    assert 0 < rows["rank.update"]["wall_ms"] < rows["step (whole trace)"]["wall_ms"]
    assert "rank.compute_logprobs" in rows  # the reference's pass (on-policy: the policy runs none)
    for metrics in steps.values():
        # exactly on-policy: no old_log_prob pass; the update's forward measures the engine's gap
        assert "timing_s/old_log_prob" not in metrics
        assert metrics["training/rollout_probs_diff_mean"] < 1e-4
        assert metrics["timing_s/update_weights"] > 0
    # step 2 samples from the weights step 1 trained: a stale engine would drift from the policy
    assert steps[2]["training/rollout_logprob_diff_mean"] < 1e-4


VARIED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return ((len(solution_str) + int(ground_truth)) % 5) / 4  # varies over prompts: advantages are not all 0
"""


def test_one_rank_in_this_process_and_one_ray_rank_train_alike(cluster, model_dir, gsm8k_files, tmp_path):
    """One path at every scale: with the same seed, a group of one rank in this process and a Ray group of
    one rank train alike (the same rank objects, FSDP2 over a world of one, seeded sampling whose draws do
    not depend on how the engine batched the requests)."""
    import asyncio

    from trainer.config import load_config
    from trainer.loop import _fit

    reward = tmp_path / "reward.py"
    reward.write_text(VARIED_REWARD)
    extra = [
        f"custom_reward_function.path={reward}",
        "reward_model.mode=local",
        "trainer.save_freq=-1",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.do_sample=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps: old logprobs computed
    ]
    for where, use_ray in (("local", "false"), ("ray", "true")):
        args = fit_args(model_dir, gsm8k_files, tmp_path / where, steps=2, ranks=1)
        asyncio.run(_fit(load_config(args + extra + [f"trainer.use_ray={use_ray}"])))
    local, on_ray = logged_steps(tmp_path / "local"), logged_steps(tmp_path / "ray")
    assert sorted(local) == sorted(on_ray) == [1, 2]
    for step in (1, 2):
        assert local[step]["critic/score/max"] > local[step]["critic/score/min"]  # something to push
        for name in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/grad_norm",
            "critic/score/mean",
            "response_length/mean",
        ):
            assert on_ray[step][name] == pytest.approx(local[step][name], rel=0, abs=1e-6), (step, name)
