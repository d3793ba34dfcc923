"""Hand-written scoring tables, each case with its expected score, run against a real reward-server process.

One server process for the module; each table goes over the wire as one batch per distinct options.
Cases marked "verl quirk" pin a behaviour copied from verl on purpose (see scorers/gsm8k.py).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import httpx
import pytest

from tests.helpers import service_process


class Case(NamedTuple):
    response: str
    truth: object  # ground_truth as the data-server sends it
    score: float
    extracted: object = ...  # ... = not checked
    options: dict | None = None
    extra_info: dict | None = None


FLEX = {"gsm8k_method": "flexible"}
FS = {"format_score": 0.1}
OVERLONG = {"overlong_enable": True, "overlong_max_len": 100, "overlong_buffer_len": 20}

GSM8K = [
    # strict (verl's default): the last "#### <number>" in the final 300 characters
    Case("#### 72", "72", 1.0, "72"),
    Case("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", 1.0, "72"),
    Case("#### 1,234", "1234", 1.0, "1234"),  # thousands separators dropped
    Case("#### 1,234,567", "1234567", 1.0, "1234567"),
    Case("#### -1,000", "-1000", 1.0, "-1000"),
    Case("#### -5", "-5", 1.0, "-5"),
    Case("#### 3.5", "3.5", 1.0, "3.5"),
    Case("#### 3.50", "3.5", 0.0, "3.50"),  # compared as strings, not numbers
    Case("#### 12\n#### 15", "15", 1.0, "15"),  # several ####: the last wins
    Case("#### 15\n#### 12", "15", 0.0, "12"),
    Case("The total is 5 #### 6 #### 7", "7", 1.0, "7"),
    Case("#### 5\n\nSo the answer is 6", "5", 1.0, "5"),  # text after the #### line is ignored
    Case("Answer: 42\n#### 42", "42", 1.0, "42"),
    Case("#### 18 dollars", "18", 1.0, "18"),
    Case("#### 72, which is it", "72", 1.0, "72"),  # the trailing comma is stripped with the others
    Case("#### 0", "0", 1.0, "0"),
    Case("The answer is 72.", "72", 0.0, None),  # no #### -> no answer
    Case("The answer is \\boxed{12}", "12", 0.0, None),
    Case("", "5", 0.0, None),
    Case("####72", "72", 0.0, None),  # verl's pattern needs the space
    Case("#### $18", "18", 0.0, None),  # verl quirk: the pattern admits no "$", so the strip never fires
    Case("#### \u22125", "-5", 0.0, None),  # verl quirk: a unicode minus is not a minus
    Case("#### - 5", "-5", 0.0, None),
    Case("#### \uff12\uff13", "23", 0.0, None),  # full-width digits are not digits here
    Case("#### 72.", "72", 0.0, "72."),  # verl quirk: the sentence's period is part of the match
    Case("#### .5", "0.5", 0.0, ".5"),
    Case("#### 007", "7", 0.0, "007"),
    Case("#### 42", "42.0", 0.0, "42"),
    Case("#### 1 234", "1234", 0.0, "1"),
    Case("x" * 400 + " #### 9", "9", 1.0, "9"),  # long response, answer at the end
    Case("#### 9 " + "y" * 300, "9", 0.0, None),  # the answer is outside the last 300 characters
    # flexible: the last number in the final 300 characters, as written
    Case("The answer is 72", "72", 1.0, "72", FLEX),
    Case("She has $18 left", "18", 1.0, "18", FLEX),
    Case("first 3 then 4 finally 5 apples", "5", 1.0, "5", FLEX),
    Case("Result: -7", "-7", 1.0, "-7", FLEX),
    Case("3.5 hours", "3.5", 1.0, "3.5", FLEX),
    Case("#### 72", "72", 1.0, "72", FLEX),
    Case("The answer is \\boxed{12}", "12", 1.0, "12", FLEX),
    Case("Total: 12 . ", "12", 1.0, "12", FLEX),  # a lone "." is skipped
    Case("no digits here", "5", 0.0, None, FLEX),
    Case("The answer is 72.", "72", 0.0, "72.", FLEX),  # verl quirk: trailing period kept
    Case("It costs 1,234 dollars", "1234", 0.0, "1,234", FLEX),  # verl quirk: flexible keeps commas
    Case("Result: \u22127", "-7", 0.0, "7", FLEX),  # unicode minus: the digits alone
    Case("Hello, world", "5", 0.0, ",", FLEX),  # verl quirk: "," counts as a number
    # format_score: an answer was found but it is wrong
    Case("#### 71", "72", 0.1, "71", FS),
    Case("#### 72", "72", 1.0, "72", FS),
    Case("no answer", "72", 0.0, None, FS),
    Case("Hello, world", "5", 0.1, ",", {**FLEX, **FS}),
]

MATH = [
    Case("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "\\frac{1}{2}"),
    Case("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    Case("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    Case("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    Case("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    Case("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    Case("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
    Case("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    Case("\\boxed{\\frac{3}{2}}", "1\\frac{1}{2}", 1.0),  # mixed number
    Case("\\boxed{0.25}", "\\frac{1}{2}", 0.0, "0.25"),
    Case("\\boxed{\\frac{1}{3}}", "0.333", 0.0),  # equal only to 6 decimal places
    Case("\\boxed{\\frac{1}{3}}", "0.333333", 1.0),
    Case("The answer is $\\boxed{12}$.", "12", 1.0, "12"),
    Case("\\boxed{12}", "13", 0.0, "12"),
    Case("\\boxed{12}", "12.0", 1.0),
    Case("\\boxed{-3}", "-3", 1.0),
    Case("\\boxed{3}", "-3", 0.0),
    Case("\\boxed{\u22123}", "-3", 1.0),  # math-verify reads a unicode minus
    Case("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    Case("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", 1.0),
    Case("\\boxed{1,000}", "1000", 1.0),  # thousands separator
    Case("\\boxed{1 234}", "1234", 0.0),
    Case("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    Case("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    Case("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    Case("\\boxed{3\\sqrt{2}}", "2\\sqrt{2}", 0.0),
    Case("\\boxed{\\sqrt{4}}", "2", 1.0),
    Case("\\boxed{\\sqrt[3]{8}}", "2", 1.0),
    Case("\\boxed{2^{10}}", "1024", 1.0),
    Case("\\boxed{\\log_2 8}", "3", 1.0),
    Case("\\boxed{\\binom{5}{2}}", "10", 1.0),
    Case("\\boxed{5!}", "120", 1.0),
    Case("\\boxed{0.1+0.2}", "0.3", 1.0),
    Case("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    Case("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    Case("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    Case("\\boxed{2x}", "x+x", 1.0),
    Case("\\boxed{x}", "y", 0.0),
    Case("\\boxed{\\sin^2 x + \\cos^2 x}", "1", 1.0),
    Case("\\boxed{\\pi}", "\\pi", 1.0),
    Case("\\boxed{2\\pi}", "2\\pi", 1.0),
    Case("\\boxed{3.14159}", "\\pi", 0.0),
    Case("\\boxed{\\infty}", "\\infty", 1.0),
    Case("\\boxed{-\\infty}", "\\infty", 0.0),
    Case("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),  # sets ignore order
    Case("\\boxed{[0,1]}", "[0,1]", 1.0),
    Case("\\boxed{(0,1)}", "[0,1]", 0.0),  # open vs closed interval
    Case("\\boxed{x=5}", "5", 1.0),  # an assignment counts by its value
    Case("\\boxed{45^\\circ}", "45", 1.0),
    Case("\\boxed{5\\text{ cm}}", "5", 1.0),  # units dropped
    Case("\\boxed{\\$18}", "18", 1.0),
    Case("\\boxed{7} but wait... \\boxed{8}", "8", 1.0, "8"),  # the last box wins
    Case("\\boxed{7} but wait... \\boxed{8}", "7", 0.0, "8"),
    Case("The answer is 12 and \\boxed{13}", "13", 1.0, "13"),  # a boxed answer beats a bare number
    Case("$x = \\boxed{-2}$ or $x=3$", "-2", 1.0),
    Case("I think it is 7", "7", 1.0, "7"),  # no box: the plain number is read
    Case("answer: 1/2", "\\frac12", 1.0),
    Case("no answer here", "5", 0.0, None),
    Case("", "5", 0.0, None),
    Case("\\boxed{12}", "13", 0.1, "12", FS),
    Case("no answer here", "13", 0.0, None, FS),
]

QA = {"target": ["Paris"]}
QA_EM = [
    Case("<answer>Paris</answer>", QA, 1.0, "Paris"),
    Case("<answer> paris </answer>", QA, 1.0, "paris"),  # stripped, lower-cased
    Case("<answer>PARIS</answer>", QA, 1.0),
    Case("<answer>\nParis\n</answer>", QA, 1.0, "Paris"),
    Case("<answer>The Paris</answer>", QA, 1.0),  # articles dropped
    Case("<answer>the the Paris</answer>", QA, 1.0),
    Case("<answer>Paris.</answer>", QA, 1.0),  # punctuation dropped
    Case("<answer>Paris!!!</answer>", QA, 1.0),
    Case("<answer>Paris, France</answer>", QA, 0.0, "Paris, France"),  # exact match, not containment
    Case("<answer>Par is</answer>", QA, 0.0),
    Case("<answer>London</answer>", QA, 0.0, "London"),
    Case("<answer>the beatles</answer>", {"target": ["The Beatles"]}, 1.0),
    Case("<answer>Beatles</answer>", {"target": ["The Beatles"]}, 1.0),
    Case("<answer>An apple</answer>", {"target": ["apple"]}, 1.0),
    Case("<answer>theatre</answer>", {"target": ["atre"]}, 0.0),  # "the" inside a word stays
    Case("<answer>A</answer>", {"target": ["a"]}, 1.0),  # both normalise to "" (SQuAD's rule)
    Case("<answer>an</answer>", {"target": ["the"]}, 1.0),  # same
    Case("<answer>New  York\nCity</answer>", {"target": ["new york city"]}, 1.0),  # whitespace collapsed
    Case("<answer>U.S.A.</answer>", {"target": ["USA"]}, 1.0),
    Case("<answer>Saint-Louis</answer>", {"target": ["saint louis"]}, 0.0),  # "-" removed, not spaced
    Case("<answer>J. K. Rowling</answer>", {"target": ["J.K. Rowling"]}, 0.0),
    Case("<answer>JK Rowling</answer>", {"target": ["J.K. Rowling"]}, 1.0),
    Case("<answer>Obama</answer>", {"target": ["Barack Obama", "Obama"]}, 1.0),  # any golden answer
    Case("<answer>Barack Obama</answer>", {"target": ["Obama"]}, 0.0),
    Case("<answer>1,000</answer>", {"target": ["1000"]}, 1.0),
    Case("<answer>1984</answer>", {"target": ["1984"]}, 1.0),
    Case("<answer>nineteen eighty-four</answer>", {"target": ["1984"]}, 0.0),
    Case("<answer>M\u00fcller</answer>", {"target": ["m\u00fcller"]}, 1.0),  # unicode lower-casing
    Case("<answer>\u201cHamlet\u201d</answer>", {"target": ["Hamlet"]}, 0.0),  # curly quotes stay
    Case("<answer></answer>", QA, 0.0, ""),
    Case("Paris", QA, 0.0, None),  # no tags, no answer
    Case("<answer>Paris", QA, 0.0, None),  # unclosed
    Case("</answer>Paris<answer>", QA, 0.0, None),
    Case("<ANSWER>Paris</ANSWER>", QA, 0.0, None),  # tags are case-sensitive
    Case("<answer>London</answer> no, <answer>Paris</answer>", QA, 1.0, "Paris"),  # the last one wins
    Case("<answer>Paris</answer> no, <answer>London</answer>", QA, 0.0, "London"),
    Case("<answer>x</answer>" * 10 + "<answer>Paris</answer>", QA, 0.25),  # 11 tags: a quarter
    Case("<answer>x</answer>" * 9 + "<answer>Paris</answer>", QA, 1.0),  # 10 tags: full
    Case(
        "<think>hmm</think><search>capital of france</search><information>Doc 1: Paris is the capital"
        "</information><answer>Paris</answer>",
        QA,
        1.0,
        "Paris",
    ),
    Case("<answer>Paris</answer>", "Paris", 1.0),  # a plain string ground truth
    Case("<answer>Paris</answer>", ["Lyon", "Paris"], 1.0),  # a plain list
    Case("<answer>London</answer>", QA, 0.1, "London", FS),
    Case("no answer", QA, 0.0, None, FS),
]

QA_F1 = [
    Case("<answer>Paris</answer>", QA, 1.0),
    Case("<answer>the Paris!</answer>", QA, 1.0),
    Case("<answer>Paris France</answer>", QA, 0.6667),  # P = 1/2, R = 1 -> 2*.5*1/1.5
    Case("<answer>Paris</answer>", {"target": ["Paris France"]}, 0.6667),  # P = 1, R = 1/2
    Case("<answer>New York City</answer>", {"target": ["New York"]}, 0.8),  # P = 2/3, R = 1
    Case("<answer>New York</answer>", {"target": ["New York City"]}, 0.8),  # P = 1, R = 2/3
    Case("<answer>York New</answer>", {"target": ["New York"]}, 1.0),  # a bag of tokens: order is free
    Case("<answer>york york</answer>", {"target": ["new york"]}, 0.5),  # overlap 1: P = 1/2, R = 1/2
    Case("<answer>a b c d</answer>", {"target": ["b c"]}, 0.8),  # "a" is an article: P = 2/3, R = 1
    Case("<answer>Barack Obama</answer>", {"target": ["Obama", "Barack Hussein Obama"]}, 0.8),  # P=1, R=2/3
    Case("<answer>Obama</answer>", {"target": ["Barack Obama", "Obama"]}, 1.0),
    Case("<answer>London</answer>", QA, 0.0),
    Case("<answer>one two three four</answer>", {"target": ["four"]}, 0.4),  # P = 1/4, R = 1
    Case("<answer>four</answer>", {"target": ["one two three four"]}, 0.4),  # P = 1, R = 1/4
    Case("<answer>one two</answer>", {"target": ["two three"]}, 0.5),  # P = R = 1/2
    Case("<answer>one two three</answer>", {"target": ["three four five"]}, 0.3333),  # P = R = 1/3
    Case("<answer>1,000 people</answer>", {"target": ["1000"]}, 0.6667),
    Case("<answer>U.S. Army</answer>", {"target": ["US Army"]}, 1.0),
    Case("<answer>the the the</answer>", QA, 0.0),  # nothing left after normalising
    Case("<answer></answer>", QA, 0.0, ""),
    Case("Paris", QA, 0.0, None),  # no answer tags
    Case("<answer>London</answer><answer>Paris</answer>", QA, 1.0, "Paris"),
    Case("<answer>Paris</answer><answer>London</answer>", QA, 0.0, "London"),
    Case("<answer>x</answer>" * 10 + "<answer>Paris</answer>", QA, 1.0),  # F1 has no tag-spam quarter
    Case("<answer>Paris</answer>", "Paris", 1.0),
    Case("<answer>Paris</answer>", ["Lyon", "Paris"], 1.0),
    Case("<answer>Lyon Paris</answer>", ["Lyon", "Paris"], 0.6667),
    Case("<answer>PARIS, FRANCE.</answer>", {"target": ["paris france"]}, 1.0),
    Case("<answer>Paris, France, Europe</answer>", {"target": ["paris france"]}, 0.8),  # P = 2/3, R = 1
    Case("<answer>M\u00fcller Thomas</answer>", {"target": ["thomas m\u00fcller"]}, 1.0),
    Case("<answer>red green blue</answer>", {"target": ["red", "green blue"]}, 0.8),  # 2nd: P=2/3, R=1
    Case("<answer>an apple a day</answer>", {"target": ["apple"]}, 0.6667),  # tokens apple, day: P=1/2, R=1
    Case("<answer>Paris Paris</answer>", QA, 0.6667),  # overlap 1: P = 1/2, R = 1
    Case("<answer>Paris</answer>", {"target": ["Paris Paris"]}, 0.6667),  # P = 1, R = 1/2
    Case("<answer>cat</answer>", {"target": ["cats"]}, 0.0),  # no stemming
    Case("<answer>twenty-one</answer>", {"target": ["twentyone"]}, 1.0),
    Case("<answer>twenty one</answer>", {"target": ["twenty-one"]}, 0.0),  # "twentyone" vs two tokens
    Case("<answer>\nParis\n</answer>", QA, 1.0, "Paris"),
    Case("<answer>London</answer>", QA, 0.1, "London", FS),  # no shared token: format_score
    Case("no answer", QA, 0.0, None, FS),
    Case("<answer>Paris France</answer>", QA, 0.6667, ..., FS),  # some overlap: the F1, not format_score
]

SHAPING = [
    # (response, truth, expected score) for gsm8k; the format is "#### <number>"
    Case("#### 72", "72", 1.1, "72", {"format_bonus": 0.1}),
    Case("#### 71", "72", 0.1, "71", {"format_bonus": 0.1}),  # 0 + bonus
    Case("The answer is 72", "72", 0.0, None, {"format_bonus": 0.1}),
    Case("The answer is 72", "72", -0.5, None, {"format_penalty": 0.5}),
    Case("#### 72", "72", 1.0, "72", {"format_penalty": 0.5}),
    Case("The answer is 72", "72", 1.0, "72", {**FLEX, "format_bonus": 0.1}),  # flexible, no ####: no bonus
    Case("#### 72", "72", 1.1, "72", {**FLEX, "format_bonus": 0.1}),
    # DAPO overlong: max_len 100, buffer 20 -> penalty starts after 80 tokens, -1 at 100
    Case("#### 72", "72", 1.0, "72", OVERLONG, {"response_length": 79}),
    Case("#### 72", "72", 1.0, "72", OVERLONG, {"response_length": 80}),
    Case("#### 72", "72", 0.5, "72", OVERLONG, {"response_length": 90}),  # 1 - 10/20
    Case("#### 72", "72", 0.0, "72", OVERLONG, {"response_length": 100}),  # 1 - 20/20
    Case("#### 72", "72", 0.0, "72", OVERLONG, {"response_length": 150}),  # clipped at -factor
    Case(
        "#### 71", "72", -0.25, "71", {**OVERLONG, "overlong_penalty_factor": 0.5}, {"response_length": 90}
    ),  # 0 - 0.5 * 10/20
    Case(
        "#### 72", "72", 0.6, "72", {**OVERLONG, "format_bonus": 0.1}, {"response_length": 90}
    ),  # 1 + 0.1 - 0.5
    Case(
        "#### 72", "72", 1.0, "72", {**OVERLONG, "overlong_buffer_len": 0}, {"response_length": 100}
    ),  # no buffer: nothing up to max_len...
    Case(
        "#### 72", "72", 0.0, "72", {**OVERLONG, "overlong_buffer_len": 0}, {"response_length": 101}
    ),  # ...and the full penalty beyond it
    Case(
        "#### 72", "72", 0.5, "72", {**OVERLONG, "overlong_buffer_len": 200}, {"response_length": 0}
    ),  # a buffer longer than max_len keeps its slope: 1 - (0 - (100 - 200)) / 200
]

TABLES = {
    "gsm8k": ("openai/gsm8k", GSM8K),
    "math": ("DigitalLearningGmbH/MATH-lighteval", MATH),
    "qa_em": ("nq", QA_EM),
    "qa_f1": ("hotpotqa", QA_F1),  # selected by the explicit scorer field below
    "shaping": ("openai/gsm8k", SHAPING),
}


def post_table(url: str, name: str) -> list[dict]:
    """Score a table over HTTP: one request per distinct options, answers put back in table order."""
    data_source, cases = TABLES[name]
    groups: dict[str, list[int]] = {}
    for index, case in enumerate(cases):
        groups.setdefault(json.dumps(case.options, sort_keys=True), []).append(index)
    results: list[dict] = [{}] * len(cases)
    for options_json, indices in groups.items():
        items = []
        for i in indices:
            item = {"data_source": data_source, "response": cases[i].response, "ground_truth": cases[i].truth}
            if cases[i].extra_info:
                item["extra_info"] = cases[i].extra_info
            if name == "qa_f1":
                item["scorer"] = "qa_f1"
            items.append(item)
        body = {"items": items, "options": json.loads(options_json)}
        response = httpx.post(url + "/v1/rewards", json=body, timeout=120)
        assert response.status_code == 200, response.text
        for i, result in zip(indices, response.json()["results"]):
            results[i] = result
    return results


@pytest.fixture(scope="module")
def server():
    args = ["--math-workers", "2", "--log-level", "warning"]
    with service_process("services.reward_server", *args) as (url, _):
        yield url


@pytest.fixture(scope="module")
def scored(server):
    return {name: post_table(server, name) for name in TABLES}


def table_params():
    for name, (_, cases) in TABLES.items():
        for index, case in enumerate(cases):
            yield pytest.param(name, index, id=f"{name}-{index}-{case.response[:24]!r}")


def test_tables_are_big_enough():
    for name in ("gsm8k", "math", "qa_em", "qa_f1"):
        assert len(TABLES[name][1]) >= 40, name


@pytest.mark.parametrize("name, index", list(table_params()))
def test_case(scored, name, index):
    case = TABLES[name][1][index]
    result = scored[name][index]
    assert result["error"] is None, result
    assert result["score"] == pytest.approx(case.score, abs=1e-4), (case, result)
    if case.extracted is not ...:
        assert result["extracted"] == case.extracted, (case, result)
    # With format_score 0 and no shaping, any credit at all means a correct answer.
    if name in ("gsm8k", "math", "qa_em") and not case.options:
        assert result["correct"] == (case.score > 0), (case, result)
