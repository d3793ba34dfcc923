"""MATH-style answers checked with math-verify: \\boxed{} / LaTeX / plain answers vs a LaTeX or plain truth.

As verl's math_verify scorer: the ground truth is wrapped as `\\boxed{<truth>}` and read as LaTeX;
the response is read as LaTeX or a plain expression (a \\boxed{} answer is preferred), and the two
are compared symbolically and numerically (\\boxed{\\frac{1}{2}} equals 0.5).
Score: 1.0 when equivalent, `format_score` when an answer was found but differs, 0.0 when none was found.

sympy can hang or exhaust memory on hostile input, and math-verify's own timeouts use SIGALRM (main
thread only, and unable to interrupt C code), so this function is only ever run inside the
reward-server's worker processes (services.scoring.pool), which kill a worker that overruns.
Here math-verify's own timeouts are off: the pool's deadline is the one that counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify warns once per process that its timeouts are disabled; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_GOLD_TARGETS = (LatexExtractionConfig(),)
_ANSWER_TARGETS = (ExprExtractionConfig(), LatexExtractionConfig())


@dataclass(frozen=True)
class MathScore:
    score: float
    correct: bool
    extracted: str | None
    well_formed: bool  # a closed \boxed{} exists: what format_bonus / format_penalty look at


def score_math(response: str, ground_truth: str, format_score: float = 0.0) -> MathScore:
    gold = parse("\\boxed{" + ground_truth + "}", extraction_config=_GOLD_TARGETS, parsing_timeout=None)
    if all(isinstance(value, str) for value in gold):  # [] or only the raw-text fallback: unreadable
        raise ValueError(f"cannot read the ground truth {ground_truth[:80]!r} as math")
    well_formed = has_format(response)
    answer = parse(response, extraction_config=_ANSWER_TARGETS, parsing_timeout=None)
    if not answer:
        return MathScore(0.0, False, None, well_formed)
    # parse() returns [sympy value, matched text]; the text is what the model wrote.
    extracted = answer[-1] if isinstance(answer[-1], str) else None
    if verify(gold, answer, timeout_seconds=None):
        return MathScore(1.0, True, extracted, well_formed)
    return MathScore(format_score, False, extracted, well_formed)


def has_format(response: str) -> bool:
    """A closed \\boxed{...} (or \\fbox{...}) somewhere in the response."""
    start = max(response.rfind("\\boxed{"), response.rfind("\\fbox{"))
    if start < 0:
        return False
    depth = 0
    for char in response[response.index("{", start) :]:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return True
    return False
