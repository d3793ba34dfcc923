"""Wire contract of the reward-server (pydantic, torch-free): what the trainer and verl send and get back.

`RewardItem` / `RewardsRequest` are the contract. `RewardItemDict` / `RewardsRequestDict` describe the
same JSON as TypedDicts: the server validates a batch with them because building one pydantic model
per item costs ~3 us, more than scoring a GSM8K answer (bench/reward_server.py); a test keeps the
two forms in step.
"""

from __future__ import annotations

from typing import Any, Literal

from services.common.wire import JsonInt
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import NotRequired, TypedDict

ScorerName = Literal["gsm8k", "math", "qa_em", "qa_f1", "model", "code", "judge"]


# Bounds on the additive terms: any sum of them stays a finite float (1e308 + 1e308 would not).
MAX_TERM = 1e6
MAX_TOKENS = 10**9


class RewardOptions(BaseModel):
    """Per-request scoring knobs. Every default lives here; the server keeps none of its own.

    Types are strict (`true` is not a number, `"3"` is not an integer) and every bound is in the schema.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    gsm8k_method: Literal["strict", "flexible"] = Field(
        "strict",
        description="strict: the last '#### <number>' in the tail; flexible: the tail's last number (verl).",
    )
    format_score: float = Field(
        0.0,
        ge=-MAX_TERM,
        le=MAX_TERM,
        description="Score of an answer that was found but is wrong (verl's format_score).",
    )
    format_bonus: float = Field(
        0.0,
        ge=0,
        le=MAX_TERM,
        description="Added when the response has the scorer's answer format (see GET /v1/scorers).",
    )
    format_penalty: float = Field(
        0.0, ge=0, le=MAX_TERM, description="Subtracted when the response lacks the scorer's answer format."
    )
    overlong_enable: bool = Field(
        False,
        description="DAPO overlong shaping; needs extra_info.response_length (tokens) on every item.",
    )
    overlong_max_len: JsonInt = Field(
        4096, ge=1, le=MAX_TOKENS, description="Longest response (tokens) the rollout may produce."
    )
    overlong_buffer_len: JsonInt = Field(
        1024,
        ge=0,
        le=MAX_TOKENS,
        description="The penalty grows linearly over the last this-many tokens before max_len "
        "(0: a full penalty only beyond max_len). A buffer longer than max_len keeps the same slope, "
        "so even short responses get part of the penalty (the trainer never sends one).",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, le=MAX_TERM, description="Penalty at (and beyond) max_len."
    )
    code_score: Literal["pass_rate", "all_pass"] = Field(
        "pass_rate",
        description="Code items: the pass rate of the first 10 test cases (verl), or 1 only when every "
        "case passes. Either way `correct` means every case passed.",
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Deadline of this request in seconds; items not scored by then get a deadline error. "
        "At most the server's request_deadline_s (GET /v1/scorers); unset: that.",
    )


class RewardItem(BaseModel):
    """One response to score: a verl row's fields plus the generated text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    data_source: str = Field(description="Selects the scorer the way verl does, e.g. 'openai/gsm8k', 'nq'.")
    response: str = Field(description="The generated text (the response only, not the prompt).")
    ground_truth: str | list[str] | dict[str, Any] = Field(
        description="reward_model.ground_truth: a string (gsm8k, math), {'target': [...]} / a list (QA), "
        "or code tests (JSON or an object: inputs/outputs[/fn_name] or assert_case)."
    )
    extra_info: dict[str, Any] | None = Field(
        None, description="verl's extra_info; response_length (tokens) here drives overlong shaping."
    )
    scorer: ScorerName | None = Field(None, description="Overrides the scorer chosen by data_source.")
    prompt: str | None = Field(None, description="The prompt text; only the reward model reads it.")


@with_config(ConfigDict(extra="forbid", strict=True))
class RewardItemDict(TypedDict):
    data_source: str
    response: str
    ground_truth: str | list[str] | dict[str, Any]
    extra_info: NotRequired[dict[str, Any] | None]
    scorer: NotRequired[ScorerName | None]
    prompt: NotRequired[str | None]


class RewardResult(BaseModel):
    score: float
    correct: bool
    extracted: str | None = None
    error: str | None = Field(None, description="Why this item could not be scored (its score is then 0).")


class RewardsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[RewardItem]
    options: RewardOptions | None = None


@with_config(ConfigDict(extra="forbid", strict=True))
class RewardsRequestDict(TypedDict):
    items: list[RewardItemDict]
    options: NotRequired[RewardOptions | None]


REWARDS_REQUEST = TypeAdapter(RewardsRequestDict)


class RewardsResponse(BaseModel):
    results: list[RewardResult]
    deadline_exceeded: bool = Field(
        False, description="True when some items were not scored before the request's deadline."
    )


class ScorerInfo(BaseModel):
    name: ScorerName
    description: str
    data_sources: str = Field(description="Which data_source values select this scorer.")
    answer_format: str = Field(description="What format_bonus / format_penalty look for.")
    available: bool


class Limits(BaseModel):
    max_items: int
    max_string_chars: int
    max_request_bytes: int
    math_timeout_s: float
    request_deadline_s: float


class ScorersResponse(BaseModel):
    scorers: list[ScorerInfo]
    default_options: RewardOptions
    limits: Limits


# The seed example's shapes (POST /reward, POST /batch_reward, GET /stats), kept so its clients keep working.
class SeedRewardRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    prompt: str
    response: str
    ground_truth: str


class SeedRewardResult(BaseModel):
    reward: float
    correct: bool
    extracted_answer: str | None = None
    details: str | None = None


class SeedBatchRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    items: list[SeedRewardRequest]


class SeedBatchResult(BaseModel):
    rewards: list[SeedRewardResult]
    accuracy: float


class SeedStats(BaseModel):
    """GET /stats: the SkyPilot job-group example's fields, then this server's counters."""

    service: str = "reward-server"
    type: str = Field(description="rule-based, or rule-based+model when a reward model is loaded.")
    supported_tasks: list[str] = Field(description="The scorers this server can run now.")
    items_scored: int = Field(description="Items scored since start, all routes.")
    item_errors: int = Field(description="Items that got an error (score 0) since start.")
    requests_past_deadline: int = Field(description="Requests that hit their deadline since start.")
    math_timeouts: int
    math_worker_crashes: int
    cancelled_math_items: int = Field(description="Math items dropped because their request ended.")


# OpenRLHF's remote reward protocol (openrlhf/utils/remote_rm_utils.py: remote_rm_fn posts these three
# lists and reads "rewards"; newer releases also read "scores" and "extra_logs").
class OpenRLHFRewardRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    query: list[str] = Field(description="Prompt + response as the policy saw them (templated).")
    prompts: list[str] | None = Field(None, description="The prompts; stripped from each query's front.")
    labels: list[str] = Field(description="Ground truths, one per query (the scorers compare to them).")
    datasources: list[str] | None = Field(None, description="data_source per query (else the default).")


class OpenRLHFRewardResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]
