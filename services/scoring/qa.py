"""Search-R1 style QA: the last `<answer>...</answer>` against a list of golden answers.

Both sides get SQuAD's normalisation (lower case, drop ASCII punctuation, drop the articles a/an/the,
collapse whitespace).
- qa_em: 1.0 when the normalised answer equals a normalised golden answer (a quarter of that when
  the response holds more than 10 opening or closing answer tags: Search-R1's guard against
  spamming tags), `format_score` when an answer was found but matches none, 0.0 when none was found.
- qa_f1: the best SQuAD token F1 over the golden answers; `format_score` when an answer was found
  but shares no token; 0.0 when none was found. `correct` is the exact match.

An empty golden-answer list is a row that nothing matches, as in verl's search_r1_like_qa_em: the
answer, if found, earns `format_score` (0.0 unless the request sets it), never an error.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_ANSWER_TAGS = 10


@dataclass(frozen=True)
class QaScore:
    score: float
    correct: bool
    extracted: str | None


def normalize_answer(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def golden_answers(ground_truth) -> list[str]:
    """{'target': [...]} (Search-R1 rows), a list (or array; empty: nothing matches), or one string;
    ValueError for anything else."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError("QA ground_truth must be {'target': [answers...]}")
        ground_truth = ground_truth["target"]
    if hasattr(ground_truth, "tolist") or isinstance(ground_truth, tuple):  # numpy arrays from parquet rows
        ground_truth = list(ground_truth)
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, list) and all(isinstance(a, str) for a in ground_truth):
        return ground_truth
    raise ValueError("QA golden answers must be strings")


def answer_spans(response: str) -> list[tuple[int, int]]:
    """(start, end) of each `<answer>...</answer>` body, as `re.finditer(r"<answer>(.*?)</answer>", DOTALL)`
    finds them, in linear time: that regex retries from every unclosed `<answer>` to the end of the text,
    so 262k characters of open tags took it 36 s."""
    spans, position = [], 0
    while (opened := response.find(OPEN_TAG, position)) >= 0:
        start = opened + len(OPEN_TAG)
        end = response.find(CLOSE_TAG, start)
        if end < 0:
            break
        spans.append((start, end))
        position = end + len(CLOSE_TAG)
    return spans


def extract_answer(response: str) -> str | None:
    spans = answer_spans(response)
    if not spans:
        return None
    start, end = spans[-1]
    return response[start:end].strip()


def too_many_tags(response: str) -> bool:
    return response.count(OPEN_TAG) > MAX_ANSWER_TAGS or response.count(CLOSE_TAG) > MAX_ANSWER_TAGS


def token_f1(prediction: str, golden: str) -> float:
    predicted_tokens, golden_tokens = normalize_answer(prediction).split(), normalize_answer(golden).split()
    overlap = sum((Counter(predicted_tokens) & Counter(golden_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted_tokens), overlap / len(golden_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, answers: list[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalize_answer(answer) == normalized for answer in answers)


def score_qa_em(response: str, answers: list[str], format_score: float = 0.0) -> QaScore:
    extracted = extract_answer(response)
    if extracted is None:
        return QaScore(0.0, False, None)
    if not exact_match(extracted, answers):
        return QaScore(format_score, False, extracted)
    return QaScore(0.25 if too_many_tags(response) else 1.0, True, extracted)


def score_qa_f1(response: str, answers: list[str], format_score: float = 0.0) -> QaScore:
    extracted = extract_answer(response)
    if extracted is None:
        return QaScore(0.0, False, None)
    best_f1 = max((token_f1(extracted, answer) for answer in answers), default=0.0)
    return QaScore(best_f1 if best_f1 > 0 else format_score, exact_match(extracted, answers), extracted)


def has_format(response: str) -> bool:
    """Exactly one answer block: one opening tag, then one closing tag."""
    return response.count(OPEN_TAG) == 1 and response.count(CLOSE_TAG) == 1 and bool(answer_spans(response))
