"""The fit loop with each rollout engine: `python -m trainer.main_ppo ... actor_rollout_ref.rollout.name=X`.

builtin: the fast engine in process, synced from the policy after every update, its logprob gap to
the trainer logged every step (verl's training/rollout_probs_diff_*). sglang: rollout servers at
ROLLOUT_SERVER_URLS (here the built-in server, which speaks SGLang's API; SGLang itself cannot be
installed here), the weights synced through /update_weights_from_disk.
"""

from __future__ import annotations

import httpx

from tests.e2e.test_train_e2e import common_args, metrics_of, seven_data, tiny_model, train  # noqa: F401
from tests.helpers import service_process


def local_args(model, data, workdir) -> list[str]:
    return common_args(model, workdir, 2) + [
        f"data.train_files={data / 'parquet/train.parquet'}",
        "reward_model.mode=local",
        "trainer.save_freq=-1",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ]


def test_builtin_engine_trains_and_logs_its_logprob_gap(tiny_model, seven_data, tmp_path):  # noqa: F811
    train(local_args(tiny_model, seven_data, tmp_path) + ["actor_rollout_ref.rollout.name=builtin"])
    steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for metrics in steps:
        # a separate engine: the trainer recomputes the old logprobs, and they match the engine's (fp32, CPU)
        assert "timing_s/old_log_prob" in metrics
        assert metrics["training/rollout_probs_diff_valid"] == 1.0
        assert metrics["training/rollout_probs_diff_max"] < 1e-3
    # the gap stays small at step 2: the engine got the updated weights (a stale engine would drift)
    assert steps[1]["training/rollout_logprob_diff_mean"] < 1e-4


def test_sglang_name_drives_the_servers_at_rollout_server_urls(tiny_model, seven_data, tmp_path):  # noqa: F811
    args = (
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--max-running-requests",
        "16",
        "--context-length",
        "256",
    )
    with service_process("trainer.rollout.server", *args) as (url, _):
        train(
            local_args(tiny_model, seven_data, tmp_path) + ["actor_rollout_ref.rollout.name=sglang"],
            env={"ROLLOUT_SERVER_URLS": url},
        )
        steps = [m for m in metrics_of(tmp_path) if "critic/score/mean" in m]
        assert [m["step"] for m in steps] == [1, 2]
        assert all(m["training/rollout_probs_diff_max"] < 1e-3 for m in steps)
        # after each update the trainer wrote a checkpoint and the server loaded it
        assert httpx.get(url + "/get_model_info").json()["model_path"] != str(tiny_model)


def test_a_run_whose_rewards_cannot_be_computed_stops_in_one_line(tiny_model, seven_data, tmp_path):  # noqa: F811
    """A data_source no scorer knows scores every sample 0 with an error: training on those zeros would
    teach nothing, so the run stops at step 1 naming the share and the first error."""
    import pandas as pd

    rows = pd.read_parquet(seven_data / "parquet/train.parquet")
    rows["data_source"] = "no-such-benchmark"
    (tmp_path / "data" / "parquet").mkdir(parents=True)
    rows.to_parquet(tmp_path / "data" / "parquet/train.parquet")
    args = local_args(tiny_model, tmp_path / "data", tmp_path) + ["reward_model.max_error_fraction=0.5"]
    done = train(args, check=False)
    assert done.returncode != 0
    assert "16 of 16 rewards could not be computed" in done.stderr
    assert "reward_model.max_error_fraction 0.5" in done.stderr and "no-such-benchmark" in done.stderr
    assert "Traceback" not in done.stderr.splitlines()[-1]
