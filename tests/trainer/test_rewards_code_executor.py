"""In-process scoring of code rows: verl's reward_model.sandbox_fusion.url reaches LocalScorer as the
code-executor's base URL (its /run_code route stripped), with the services' bearer token."""

from __future__ import annotations

import asyncio

import pytest

from trainer.config import CustomRewardFunction, RewardModelConfig, ServicesConfig
from trainer.rewards import close_scorer, code_executor_base_url, open_scorer


@pytest.mark.parametrize(
    ("sandbox_url", "base"),
    [
        ("http://code:8003/run_code", "http://code:8003"),
        ("http://code:8003/run_code/", "http://code:8003"),
        ("http://code:8003", "http://code:8003"),
        ("http://a:8003/run_code, http://b:8003/run_code", "http://a:8003,http://b:8003"),
        (None, None),
        ("", None),
    ],
)
def test_sandbox_fusion_url_as_the_code_executor_base(sandbox_url, base):
    assert code_executor_base_url(sandbox_url) == base


def test_the_url_and_token_reach_the_local_scorer():
    async def scorer_settings(sandbox_url):
        scorer = await open_scorer(
            RewardModelConfig(mode="local", sandbox_fusion={"url": sandbox_url}),
            ServicesConfig(auth_token="tok"),
            CustomRewardFunction(),
        )
        try:
            return scorer.settings, scorer.available("code")
        finally:
            await close_scorer(scorer)

    settings, code = asyncio.run(scorer_settings("http://code:8003/run_code"))
    assert (settings.code_executor_url, settings.code_executor_token, code) == (
        "http://code:8003",
        "tok",
        True,
    )
    settings, code = asyncio.run(scorer_settings(None))  # the negative control: no URL, no code scorer
    assert (settings.code_executor_url, code) == (None, False)


def test_verls_sandbox_fusion_url_key_takes_effect_and_its_bounds_are_accepted():
    from trainer.config.cli import load_config

    cfg = load_config(
        [
            "reward_model.sandbox_fusion.url=http://code:8003/run_code",
            "reward_model.sandbox_fusion.max_concurrent=64",
            "reward_model.sandbox_fusion.memory_limit_mb=1024",
        ]
    )
    assert cfg.reward_model.sandbox_fusion.url == "http://code:8003/run_code"


@pytest.mark.parametrize(
    ("scored_by", "notice"),
    [
        (["reward_model.mode=local"], None),
        (
            ["reward_model.mode=server", "services.reward_url=http://reward:8001"],
            "with reward_model.mode=server",
        ),
        (["reward_model.mode=local", "custom_reward_function.path=REWARD"], "custom_reward_function"),
    ],
)
def test_sandbox_fusion_url_where_it_has_no_effect_says_so(scored_by, notice, tmp_path):
    """Only the in-process scorer runs code rows on sandbox_fusion.url; elsewhere the key is named."""
    from trainer.config import checks
    from trainer.config.cli import load_config

    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    args = [arg.replace("REWARD", str(reward)) for arg in scored_by]
    cfg = load_config(["reward_model.sandbox_fusion.url=http://code:8003/run_code", *args])
    said = [line for line in checks.notices(cfg) if "sandbox_fusion.url" in line]
    assert said == [] if notice is None else len(said) == 1 and notice in said[0]
