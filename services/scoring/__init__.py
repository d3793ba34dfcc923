"""The scoring library: what the reward-server serves and the trainer's in-process mode runs.

    from services.scoring import LocalScorer
    async with LocalScorer(math_workers=2) as scorer:
        results = await scorer.score([{"data_source": "openai/gsm8k", "response": "#### 72",
                                       "ground_truth": "72"}])

`LocalScorer` dispatches each item to a scorer the way verl's `default_compute_score` does (see
`local.py`); the pure scorers are one module per family: gsm8k, math (math-verify, run in the
killable `pool`), qa (EM / F1), shaping (format terms, DAPO overlong), model (a neural reward model),
judge (an LLM judge over any OpenAI-compatible chat endpoint).
Items and options use the reward-server's wire records (services.reward_server.schemas), so a reward
is the same number over HTTP and in-process.
"""

from services.scoring.local import (
    DEFAULT_OPTIONS,
    SCORER_DOCS,
    LocalScorer,
    Scored,
    ScorerDoc,
    ScorerSettings,
    scorer_for,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "SCORER_DOCS",
    "LocalScorer",
    "Scored",
    "ScorerDoc",
    "ScorerSettings",
    "scorer_for",
]
