"""Which scorer an item gets, and `LocalScorer`, which scores batches: the scoring library.

The reward-server (a thin HTTP layer over it) and the trainer's in-process mode run this same
class, so a reward is the same number whichever path computed it.

Dispatch follows verl's `default_compute_score`; an item's explicit `scorer` field wins, then its
`extra_info.scorer` (the data-server writes "qa_em" there on QA rows, so a QA set served under any
dataset name is scored as QA, not as an unknown data_source worth 0):
  openai/gsm8k, gsm8k, synthetic-arith                                  -> gsm8k
  nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle,
  searchR1_*                                                             -> qa_em
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, math_dapo, any name
  containing "math", aime*, amc*, numina_*                               -> math
  codecontests, apps, codeforces, taco, humaneval, openai/openai_humaneval -> code
verl scores math_dapo/aime with its own "Answer:" scorer and numina_* with prime_math; here all of
them go through math-verify, which reads those answer styles too.

A deliberate departure in QA routing: verl routes only its seven searchR1_{nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa, musique, bamboogle} names to its QA scorer and raises for any other name. Here any
`searchR1_` prefix and the bare dataset names score as QA too, so QA rows served under other names
(the data-server's own QA sets, issue 30) get a reward rather than an error. A name verl knows gets
verl's number; an empty golden-answer list scores like verl's (nothing matches: format_score, 0.0).

The `judge` scorer (no data_source selects it: set `scorer` or `extra_info.scorer`) asks an
OpenAI-compatible chat endpoint (`judge_url`) to grade each response (services.scoring.judge), at most
`judge_concurrency` requests in flight across every batch this scorer serves.

Cheap scorers (gsm8k, QA) run in one thread beside the caller's event loop (never on it: a batch of
16k items is tens of milliseconds of CPU), in linear time whatever the text. math-verify runs in the
killable worker pool with a deadline per item, queued fairly against other batches; the reward model
runs in a thread; code items run their test cases in the code-executor (`code_executor_url`), one
batch request per scored batch. A batch has a deadline too (`request_deadline_s`, or a shorter
`options.deadline_s`): items not scored by then get a "deadline" error, and their queued or running
pool work is dropped, as it is when the caller stops waiting (the server cancels a batch whose client
disconnected). An item that cannot be scored (unknown data_source, a ground truth of the wrong shape, a
timeout) gets score 0 and `error`; the rest of its batch is unaffected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import math
import os
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from services.code_executor.client import CodeExecutorClient
from services.common.client import ServiceError
from services.reward_server.schemas import RewardItem, RewardOptions, RewardResult, ScorerName
from services.scoring import code as code_scorer
from services.scoring import gsm8k, qa, shaping
from services.scoring import math as math_scorer
from services.scoring.judge import JudgeItem, JudgeSettings, LLMJudge
from services.scoring.pool import KillablePool

GSM8K_SOURCES = frozenset({"openai/gsm8k", "gsm8k", "synthetic-arith"})
QA_SOURCES = frozenset({"nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"})
MATH_PREFIXES = ("aime", "amc", "numina_")
CODE_SOURCES = frozenset(
    {"codecontests", "apps", "codeforces", "taco", "humaneval", "openai/openai_humaneval"}
)
MAX_RESPONSE_TOKENS = 10**9  # beyond any context window; bounds the overlong arithmetic
DEFAULT_OPTIONS = RewardOptions()


class ScorerDoc(NamedTuple):
    """What GET /v1/scorers says about a scorer."""

    description: str
    data_sources: str  # which data_source values select it
    answer_format: str  # what format_bonus / format_penalty look for


SCORER_DOCS: dict[str, ScorerDoc] = {
    "gsm8k": ScorerDoc(
        description="verl's GSM8K rule: the last '#### <number>' (strict) or the last number (flexible) "
        "in the final 300 characters, compared as a string.",
        data_sources="openai/gsm8k, gsm8k, synthetic-arith",
        answer_format="a '#### <number>' in the final 300 characters",
    ),
    "math": ScorerDoc(
        description="math-verify: a \\boxed{} / LaTeX / plain answer, equal symbolically or numerically.",
        data_sources="lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, math_dapo, names containing "
        "'math', aime*, amc*, numina_*",
        answer_format="a closed \\boxed{...}",
    ),
    "qa_em": ScorerDoc(
        description="Search-R1 exact match: the last <answer>...</answer>, SQuAD-normalised, "
        "against the golden answers.",
        data_sources="nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle, searchR1_*; "
        "any data_source whose row says extra_info.scorer='qa_em' (the data-server's QA rows). Wider "
        "than verl, which scores only its seven searchR1_* names and raises for others; an empty "
        "golden list scores as verl's does (format_score, no error)",
        answer_format="exactly one <answer>...</answer>",
    ),
    "qa_f1": ScorerDoc(
        description="Search-R1 token F1: the best SQuAD F1 of the last <answer>...</answer> "
        "over the golden answers.",
        data_sources="none (select with scorer='qa_f1')",
        answer_format="exactly one <answer>...</answer>",
    ),
    "code": ScorerDoc(
        description="The response's last ```python block run against the row's test cases in the "
        "code-executor: the pass rate of the first 10 cases (verl), or all-pass (options.code_score).",
        data_sources="codecontests, apps, codeforces, taco, humaneval, openai/openai_humaneval",
        answer_format="a ```python code block",
    ),
    "model": ScorerDoc(
        description="A neural reward model (AutoModelForSequenceClassification) scoring (prompt, response).",
        data_sources="none (select with scorer='model')",
        answer_format="none (no format terms)",
    ),
    "judge": ScorerDoc(
        description="An LLM judge: an OpenAI-compatible chat endpoint (judge_url) grades (prompt, "
        "response, ground truth as the reference); the last number of its reply over judge_scale, "
        "in [0, 1]. A reply without a grade is that item's error.",
        data_sources="none (select with scorer='judge' or extra_info.scorer='judge')",
        answer_format="none (no format terms)",
    ),
}
UNSHAPED_SCORERS = frozenset({"model", "judge"})  # scores with no answer format to reward


class ScorerSettings(BaseModel):
    """What scoring needs beyond the request: worker pool, deadlines, the optional reward model."""

    math_workers: int = Field(
        default_factory=lambda: max(1, min(4, os.cpu_count() or 1)),
        ge=1,
        description="Processes running math-verify (default: CPUs, at most 4).",
    )
    math_timeout_s: float = Field(
        10.0, gt=0, description="Deadline per math item; past it the worker is killed."
    )
    request_deadline_s: float = Field(
        120.0,
        gt=0,
        description="Deadline of a whole batch; items not scored by then fail with a deadline error. "
        "Keep it below the clients' timeout (the trainer's is 300 s) so a client never retries work "
        "the server is still doing.",
    )
    math_memory_limit_mb: int = Field(
        4096, ge=0, description="Address-space limit of each math worker in MiB (0: none)."
    )
    reward_model: str | None = Field(
        None, description="AutoModelForSequenceClassification path or hub id; enables scorer 'model'."
    )
    model_device: str = Field("auto", description="auto (cuda when available), cpu, cuda or cuda:N.")
    model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on GPU, float32 on CPU."
    )
    model_batch_size: int = Field(16, ge=1, description="Pairs per reward-model forward pass.")
    model_max_length: int = Field(4096, ge=8, description="Tokens per pair; longer inputs lose their start.")
    model_threshold: float = Field(0.0, description="A reward-model score above this counts as `correct`.")
    model_trust_remote_code: bool = Field(False, description="Allow the reward model's own modelling code.")
    code_executor_url: str | None = Field(
        None,
        description="code-executor base URL(s), comma-separated (e.g. http://127.0.0.1:8003); enables "
        "scorer 'code'.",
    )
    code_run_timeout_s: float = Field(10.0, gt=0, description="Wall time of one code test case (verl: 10).")
    code_memory_mb: int = Field(1024, ge=16, description="Memory of one code test case in MiB (verl: 1024).")
    code_executor_token: str | None = Field(
        None, description="Bearer token the code-executor asks for (its --auth-token), when it has one."
    )
    judge_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL ending in /v1 (e.g. a rollout server's "
        "http://127.0.0.1:30000/v1); enables scorer 'judge'.",
    )
    judge_model: str = Field("default", description="The `model` field of each judge request.")
    judge_api_key: str | None = Field(
        None, description="Bearer token of the judge endpoint, if it wants one."
    )
    judge_concurrency: int = Field(8, ge=1, description="Most judge requests in flight, over all batches.")
    judge_timeout_s: float = Field(60.0, gt=0, description="Bound on one judge request.")
    judge_scale: float = Field(10.0, gt=0, description="The judge's grade that means a score of 1.0.")
    judge_max_tokens: int = Field(16, ge=1, description="Longest reply the judge may write.")
    judge_threshold: float = Field(
        0.5, ge=0, le=1, description="A judge score (in [0, 1]) at or above this counts as `correct`."
    )

    @field_validator("code_executor_url", "judge_url")
    @classmethod
    def _http_urls(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Refused here, at startup: an empty or scheme-less URL would still switch its scorer on and then
        fail every item it scores (an empty code_executor_url as a 500 for the whole request)."""
        if value is None:
            return None
        many = info.field_name == "code_executor_url"  # replicas, comma-separated
        urls = [url.strip() for url in value.split(",") if url.strip()] if many else [value.strip()]
        for url in urls or [value]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"{url[:80]!r} is not an http:// or https:// URL (leave it unset to turn its scorer off)"
                )
        return value


@dataclass(slots=True)
class Scored:
    """One item's outcome before shaping; `well_formed` feeds the format terms."""

    scorer: str
    score: float = 0.0
    correct: bool = False
    extracted: str | None = None
    error: str | None = None
    well_formed: bool = False
    late: bool = False  # not scored before the batch's deadline


@functools.lru_cache(maxsize=4096)
def scorer_for(data_source: str) -> ScorerName | None:
    """The scorer verl would pick for this data_source; None when there is none."""
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in QA_SOURCES or data_source.startswith("searchR1_"):
        return "qa_em"
    if data_source in CODE_SOURCES:
        return "code"
    lowered = data_source.lower()
    if "math" in lowered or lowered.startswith(MATH_PREFIXES):
        return "math"
    return None


def item_scorer(item: dict) -> str | None:
    """The item's `scorer`, else its row's `extra_info.scorer`, else the one its data_source selects."""
    return item.get("scorer") or _hinted_scorer(item) or scorer_for(item["data_source"])


def _hinted_scorer(item: dict) -> str | None:
    extra = item.get("extra_info")
    hint = extra.get("scorer") if isinstance(extra, dict) else None
    return hint if isinstance(hint, str) and hint else None


def failed(scorer: str, error: str) -> Scored:
    return Scored(scorer, error=error)


def late(scorer: str, deadline_s: float) -> Scored:
    error = f"request deadline of {deadline_s:g}s passed before this item was scored"
    return Scored(scorer, error=error, late=True)


def finite(scored: Scored) -> Scored:
    """A reward must be a number a trainer can add up: a reward model's NaN is that item's error."""
    if math.isfinite(scored.score):
        return scored
    return failed(scored.scorer, f"the score is not a finite number ({scored.score})")


def score_gsm8k_item(item: dict, options: RewardOptions) -> Scored:
    ground_truth = item["ground_truth"]
    if not isinstance(ground_truth, str):
        return failed("gsm8k", "gsm8k ground_truth must be a string such as '72'")
    result = gsm8k.score_gsm8k(item["response"], ground_truth, options.gsm8k_method, options.format_score)
    well_formed = options.gsm8k_method == "strict" and result.extracted is not None
    if not well_formed and (options.format_bonus or options.format_penalty):
        well_formed = gsm8k.has_format(item["response"])
    return Scored("gsm8k", result.score, result.correct, result.extracted, None, well_formed)


def score_qa_item(item: dict, scorer: str, options: RewardOptions) -> Scored:
    try:
        answers = qa.golden_answers(item["ground_truth"])
    except ValueError as exc:
        return failed(scorer, str(exc))
    score_fn = qa.score_qa_em if scorer == "qa_em" else qa.score_qa_f1
    result = score_fn(item["response"], answers, options.format_score)
    return Scored(
        scorer, result.score, result.correct, result.extracted, None, qa.has_format(item["response"])
    )


def shape(scored: Scored, item: dict, options: RewardOptions) -> Scored:
    """Add the format term and the overlong penalty the request switched on."""
    if scored.error is not None:
        return scored
    if scored.scorer not in UNSHAPED_SCORERS and (options.format_bonus or options.format_penalty):
        scored.score += shaping.format_term(scored.well_formed, options.format_bonus, options.format_penalty)
    if options.overlong_enable:
        length = (item.get("extra_info") or {}).get("response_length")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_RESPONSE_TOKENS:
            return failed(
                scored.scorer,
                "overlong shaping needs extra_info.response_length "
                f"(a token count in 0..{MAX_RESPONSE_TOKENS})",
            )
        scored.score += shaping.overlong_penalty(
            length, options.overlong_max_len, options.overlong_buffer_len, options.overlong_penalty_factor
        )
    return scored


def unknown_scorer_message(item: dict) -> str:
    if item.get("scorer"):  # only dicts given to LocalScorer directly; the server validated the name
        return f"unknown scorer {item['scorer']!r}; use one of {', '.join(SCORER_DOCS)}"
    if _hinted_scorer(item):
        return f"unknown extra_info.scorer {_hinted_scorer(item)!r}; use one of {', '.join(SCORER_DOCS)}"
    return (
        f"no scorer for data_source {item['data_source'][:80]!r}; set `scorer` to one of "
        f"{', '.join(SCORER_DOCS)} (GET /v1/scorers lists the data sources)"
    )


def score_inline(items: Sequence[dict], names: Sequence[str | None], options: RewardOptions) -> list:
    """The cheap scorers' items (gsm8k, QA, unknown names); None where math or the model will score."""
    scored: list[Scored | None] = []
    for item, name in zip(items, names):
        if name == "gsm8k":
            scored.append(score_gsm8k_item(item, options))
        elif name == "qa_em" or name == "qa_f1":
            scored.append(score_qa_item(item, name, options))
        elif name in ("math", "model", "code", "judge"):
            scored.append(None)
        else:
            scored.append(failed("none", unknown_scorer_message(item)))
    return scored


def to_result(scored: Scored) -> RewardResult:
    return RewardResult(
        score=scored.score, correct=scored.correct, extracted=scored.extracted, error=scored.error
    )


class LocalScorer:
    """Scores batches in this process: the reward-server's engine, and the trainer's `mode=local`.

    `LocalScorer()` or `LocalScorer(settings)` or `LocalScorer(math_workers=2, ...)`. Starts its math
    workers (and loads the reward model, if one is named) at construction; call `close()` when done.
    The workers come from a multiprocessing forkserver, so, as with any multiprocessing user, a script
    that builds one needs the `if __name__ == "__main__":` guard.
    """

    def __init__(self, settings: ScorerSettings | None = None, **fields) -> None:
        if settings is not None and fields:
            raise TypeError("pass either a ScorerSettings or its fields, not both")
        self.settings = settings or ScorerSettings(**fields)
        self.math_pool = KillablePool(
            math_scorer.score_math,
            workers=self.settings.math_workers,
            timeout_s=self.settings.math_timeout_s,
            memory_limit_mb=self.settings.math_memory_limit_mb,
        )
        self.math_pool.start()
        self._inline = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inline-scoring")
        self.judge = judge_of(self.settings)
        self.reward_model = None
        try:
            if self.settings.reward_model:
                from services.scoring.model import RewardModel

                s = self.settings
                self.reward_model = RewardModel(
                    s.reward_model,
                    device=s.model_device,
                    dtype=s.model_dtype,
                    batch_size=s.model_batch_size,
                    max_length=s.model_max_length,
                    trust_remote_code=s.model_trust_remote_code,
                )
        except BaseException:
            self.math_pool.close()
            raise

    def close(self) -> None:
        self.math_pool.close()
        self._inline.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> LocalScorer:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def available(self, scorer: str) -> bool:
        if scorer == "code":
            return self.settings.code_executor_url is not None
        if scorer == "judge":
            return self.judge is not None
        return scorer != "model" or self.reward_model is not None

    def deadline_of(self, options: RewardOptions) -> float:
        """A request may ask for a shorter deadline than the server's, never a longer one."""
        limit = self.settings.request_deadline_s
        return limit if options.deadline_s is None else min(options.deadline_s, limit)

    async def score(
        self, items: Sequence[RewardItem | dict], options: RewardOptions | None = None
    ) -> list[RewardResult]:
        # A pydantic model keeps its field values in __dict__: the dict form the core reads, for free.
        fields = [item if isinstance(item, dict) else vars(item) for item in items]
        return [to_result(scored) for scored in await self.score_items(fields, options)]

    async def score_items(self, items: Sequence[dict], options: RewardOptions | None = None) -> list[Scored]:
        """Like `score`, for items as validated dicts (schemas.RewardItemDict), keeping which scorer ran."""
        options = options or DEFAULT_OPTIONS
        deadline_s = self.deadline_of(options)
        names = [item_scorer(item) for item in items]
        math_indices = [i for i, name in enumerate(names) if name == "math"]
        model_indices = [i for i, name in enumerate(names) if name == "model"]
        code_indices = [i for i, name in enumerate(names) if name == "code"]
        judge_indices = [i for i, name in enumerate(names) if name == "judge"]
        loop = asyncio.get_running_loop()
        inline = loop.run_in_executor(self._inline, score_inline, items, names, options)
        group = object()  # one fair-queue group per batch: the pool alternates between batches
        slow = self._within_deadline(
            [
                *(self._score_math(items[i], options, group) for i in math_indices),
                self._score_model([items[i] for i in model_indices]),
                self._score_code([items[i] for i in code_indices], options),
                self._score_judge([items[i] for i in judge_indices]),
            ],
            deadline_s,
        )
        scored, (*math_scored, model_scored, code_scored, judge_scored) = await asyncio.gather(inline, slow)
        for index, value in zip(math_indices, math_scored):
            scored[index] = value or late("math", deadline_s)
        if model_scored is None:
            model_scored = [late("model", deadline_s)] * len(model_indices)
        for index, value in zip(model_indices, model_scored):
            scored[index] = value
        if code_scored is None:
            code_scored = [late("code", deadline_s)] * len(code_indices)
        for index, value in zip(code_indices, code_scored):
            scored[index] = value
        if judge_scored is None:
            judge_scored = [late("judge", deadline_s)] * len(judge_indices)
        for index, value in zip(judge_indices, judge_scored):
            scored[index] = value
        if options.format_bonus or options.format_penalty or options.overlong_enable:
            scored = [shape(value, item, options) for value, item in zip(scored, items)]
        return [finite(value) for value in scored]

    @staticmethod
    async def _within_deadline(jobs: list[Awaitable], deadline_s: float) -> list:
        """Each job's result, or None for those still running at the deadline (they are cancelled)."""
        tasks = [asyncio.ensure_future(job) for job in jobs]
        try:
            done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        finally:  # the deadline, or our own caller cancelling us: drop the pool work either way
            for task in tasks:
                task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return [task.result() if task in done else None for task in tasks]

    async def _score_math(self, item: dict, options: RewardOptions, group: object) -> Scored:
        if not isinstance(item["ground_truth"], str):
            return failed("math", "math ground_truth must be a string (LaTeX or plain)")
        outcome = await self.math_pool.run(
            item["response"], item["ground_truth"], options.format_score, group=group
        )
        if outcome.error is not None:
            return failed("math", f"math-verify: {outcome.error}")
        value = outcome.value
        return Scored("math", value.score, value.correct, value.extracted, None, value.well_formed)

    async def _score_model(self, items: list[dict]) -> list[Scored]:
        if not items:
            return []
        if self.reward_model is None:
            return [
                failed("model", "no reward model loaded (start the server with --reward-model)")
                for _ in items
            ]
        prompts = [item.get("prompt") or "" for item in items]
        responses = [item["response"] for item in items]
        try:
            values = await asyncio.to_thread(self.reward_model.score, prompts, responses)
        except Exception as exc:  # noqa: BLE001 - e.g. CUDA out of memory: these items fail, the server lives
            return [failed("model", f"reward model failed: {type(exc).__name__}: {exc}") for _ in items]
        threshold = self.settings.model_threshold
        return [Scored("model", value, value > threshold) for value in values]

    async def _score_code(self, items: list[dict], options: RewardOptions) -> list[Scored]:
        """Every test case of every item in one batch to the code-executor (split by its client)."""
        if not items:
            return []
        if self.settings.code_executor_url is None:
            return [failed("code", "no code-executor configured (code_executor_url)") for _ in items]
        plans = [code_plan(item, self.settings) for item in items]
        requests = [request for plan in plans if not isinstance(plan, Scored) for request in plan[1]]
        try:
            async with CodeExecutorClient(
                self.settings.code_executor_url, timeout_s=600.0, token=self.settings.code_executor_token
            ) as client:
                responses = await client.run_batch(requests)
        except ServiceError as exc:
            return [failed("code", f"code-executor: {exc}") for _ in items]
        scored, position = [], 0
        for plan in plans:
            if isinstance(plan, Scored):
                scored.append(plan)
                continue
            tests, requests_of_item = plan
            answers = responses[position : position + len(requests_of_item)]
            position += len(requests_of_item)
            scored.append(judge_code(tests, answers, options.code_score == "all_pass"))
        return scored

    async def _score_judge(self, items: list[dict]) -> list[Scored]:
        """One judge request per item, bounded by the judge's concurrency across all batches."""
        if not items:
            return []
        if self.judge is None:
            error = "no judge configured (judge_url: the reward-server's --judge-url)"
            return [failed("judge", error) for _ in items]
        asked = [JudgeItem(item.get("prompt") or "", item["response"], reference(item)) for item in items]
        results = await self.judge.score(asked)
        threshold = self.settings.judge_threshold
        return [
            failed("judge", result.error)
            if result.score is None
            else Scored("judge", result.score, result.score >= threshold, result.reply)
            for result in results
        ]


def judge_of(settings: ScorerSettings) -> LLMJudge | None:
    if settings.judge_url is None:
        return None
    return LLMJudge(
        JudgeSettings(
            url=settings.judge_url,
            model=settings.judge_model,
            api_key=settings.judge_api_key,
            scale=settings.judge_scale,
            max_tokens=settings.judge_max_tokens,
            concurrency=settings.judge_concurrency,
            timeout_s=settings.judge_timeout_s,
        )
    )


def reference(item: dict) -> str:
    """The ground truth as the judge's reference answer: a string as is, answers joined by ' | '."""
    truth = item["ground_truth"]
    if isinstance(truth, dict) and "target" in truth:
        truth = truth["target"]
    if isinstance(truth, str):
        return truth
    if isinstance(truth, list) and all(isinstance(answer, str) for answer in truth):
        return " | ".join(truth)
    return json.dumps(truth, sort_keys=True, default=str)


def code_plan(item: dict, settings: ScorerSettings):
    """An item's test runs as (tests, requests), or its final Scored when there is nothing to run."""
    try:
        tests = code_scorer.parse_tests(item["ground_truth"])
    except ValueError as exc:
        return failed("code", str(exc))
    program = code_scorer.extract_code(item["response"])
    if program is None:
        return Scored("code", 0.0, False, None, None, False)
    requests = code_scorer.case_requests(program, tests, settings.code_run_timeout_s, settings.code_memory_mb)
    return tests, requests


def judge_code(tests, responses, all_pass: bool) -> Scored:
    problem = code_scorer.sandbox_failure(responses)
    if problem is not None:
        return failed("code", problem)
    passed = [code_scorer.case_passed(case, response) for case, response in zip(tests.cases, responses)]
    score, correct = code_scorer.code_score(passed, all_pass)
    return Scored("code", score, correct, f"{sum(passed)}/{len(passed)} cases passed", None, True)
