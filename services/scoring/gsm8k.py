"""GSM8K answers, with verl's semantics (verl/utils/reward_score/gsm8k.py) reproduced exactly.

Only the last 300 characters are read (verl's cut: the final answer sits at the end, and regexes
over long texts are slow).
- strict: the last `#### <number>` match; commas and `$` removed; compared as a string.
- flexible: the last run of digits, `.`, `,` (with an optional leading `-`), compared as written.
Score: 1.0 when equal to the ground truth, `format_score` when an answer was found but differs,
0.0 when none was found.

verl quirks kept on purpose, so rewards match what verl would have given (tests pin each):
`#### $18` has no strict match (the regex admits no `$`; verl's `$` removal never fires); a
unicode minus (U+2212) is not a minus; flexible keeps commas and a trailing period ("1,234",
"18." are wrong against "1234", "18"); flexible can return "," or "." when nothing better exists.

`last_number` is ours, not verl's: the seed-compatible routes, whose items carry no data_source,
use strict with it as the fallback (the last number, commas and `$` dropped, no trailing period).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")
_NOT_AN_ANSWER = ("", ".")


@dataclass(frozen=True)
class Gsm8kScore:
    score: float
    correct: bool
    extracted: str | None


def tail(text: str) -> str:
    return text[-TAIL_CHARS:] if len(text) > TAIL_CHARS else text


def extract_strict(text: str) -> str | None:
    matches = _STRICT.findall(tail(text))
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def extract_flexible(text: str) -> str | None:
    matches = _FLEXIBLE.findall(tail(text))
    if not matches:
        return None
    # verl walks back to the last match that is not "" or "."; if all are, it keeps the first one.
    for candidate in reversed(matches):
        if candidate not in _NOT_AN_ANSWER:
            return candidate
    return matches[0]


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(tail(text))
    return matches[-1].replace(",", "").replace("$", "") if matches else None


def judge(extracted: str | None, ground_truth: str, format_score: float) -> Gsm8kScore:
    if extracted is None:
        return Gsm8kScore(0.0, False, None)
    correct = extracted == ground_truth
    return Gsm8kScore(1.0 if correct else format_score, correct, extracted)


def score_gsm8k(
    response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0
) -> Gsm8kScore:
    extracted = extract_strict(response) if method == "strict" else extract_flexible(response)
    return judge(extracted, ground_truth, format_score)


def score_seed(response: str, ground_truth: str) -> tuple[Gsm8kScore, str]:
    """The seed routes: strict, else the last number. Returns the score and which rule read the answer."""
    extracted = extract_strict(response)
    if extracted is not None:
        return judge(extracted, ground_truth.replace(",", "").strip(), 0.0), "gsm8k strict (#### answer)"
    return judge(
        last_number(response), ground_truth.replace(",", "").strip(), 0.0
    ), "gsm8k last number (no ####)"


def has_format(response: str) -> bool:
    return _STRICT.search(tail(response)) is not None
