"""Wire contract of the data-server (pydantic, torch-free). Items carry verl's row fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.wire import JsonInt

# verl's GSM8K preprocessing appends exactly this to each question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl's MATH preprocessing asks for a boxed answer.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class RewardSpec(BaseModel):
    style: str = "rule"
    ground_truth: str | list[str] | dict[str, Any]


class Item(BaseModel):
    """One prompt, as a row of verl's parquet plus a stable `uid`."""

    model_config = ConfigDict(extra="allow")

    uid: str = Field(description="Stable id: '{dataset}/{split}/{index}'. The same across epochs.")
    data_source: str = Field(description="Selects the reward scorer, e.g. 'openai/gsm8k'.")
    prompt: list[ChatMessage]
    ability: str
    reward_model: RewardSpec
    extra_info: dict[str, Any] = Field(default_factory=dict)


# `<epoch>.<offset>.<fingerprint>`: ASCII digits only (str.isdigit() also takes "²", which int() refuses)
# and few enough that int() stays cheap; 18 digits is past any real epoch or offset.
CURSOR_PATTERN = r"^([0-9]{1,18})\.([0-9]{1,18})\.([0-9a-f]{8})$"


class BatchRequest(BaseModel):
    """Strict types: `batch_size: true` or `"8"` is a 422, not a silent coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: str = Field("synthetic-arith", description="A name from GET /v1/datasets.")
    split: str = Field("train", description="A split of that dataset, e.g. train or test.")
    batch_size: JsonInt = Field(
        ..., ge=1, description="Items to return (at most the server's max_batch_size)."
    )
    cursor: str | None = Field(
        None,
        pattern=CURSOR_PATTERN,
        description="next_cursor of the previous batch (`<epoch>.<offset>.<fingerprint>`); omit to start "
        "at epoch 0, offset 0.",
    )


class BatchResponse(BaseModel):
    items: list[Item]
    next_cursor: str = Field(description="Pass back to get the following batch; save it to resume.")
    epoch: int = Field(description="Epoch of the first item in this batch.")
    offset: int = Field(description="Position of the first item within that epoch's order.")
    dataset_size: int


class DatasetInfo(BaseModel):
    name: str
    kind: str
    data_source: str
    splits: dict[str, int]


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]


# The seed example's shapes (GET /prompts, GET /stats), kept so its clients keep working.
class SeedPrompt(BaseModel):
    prompt: str
    ground_truth: str
    question_id: str | None = None


class SeedPromptBatch(BaseModel):
    prompts: list[SeedPrompt]
    total_available: int


class SeedStats(BaseModel):
    total_prompts: int = Field(
        description="Prompts GET /prompts draws from by default (the first dataset's train split): "
        "the same number as its total_available."
    )
    dataset: str = Field(description="The dataset GET /prompts serves by default.")
    datasets: dict[str, dict[str, int]] = Field(description="Every dataset's split sizes.")
