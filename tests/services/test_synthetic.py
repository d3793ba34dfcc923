"""synthetic-arith's `bare` level (the CPU demo's task): right answers, its own instruction, stable."""

from __future__ import annotations

from services.data_server.schemas import GSM8K_INSTRUCTION
from services.data_server.sources import load_spec, synthetic_rows
from services.data_server.synthetic import BARE_INSTRUCTION, make_problem


def test_bare_problems_are_sums_and_differences_with_right_answers():
    problems = [make_problem(0, "train", index, "bare") for index in range(500)]
    for problem in problems:
        a, op, b = problem.question.removeprefix("Compute ").removesuffix(".").split()
        a, b = int(a), int(b)
        assert 1 <= a <= 20 and 1 <= b <= 20
        assert problem.result == (a + b if op == "+" else a - b) >= 0
        assert problem.answer.endswith(f"#### {problem.result}")
        assert problem.instruction == BARE_INSTRUCTION
    ops = [p.question.split()[2] for p in problems]
    assert 200 < ops.count("+") < 300  # both operations, about evenly
    assert make_problem(0, "train", 7, "bare") == make_problem(0, "train", 7, "bare")
    assert make_problem(0, "train", 7, "bare") != make_problem(0, "test", 7, "bare")


def test_rows_carry_each_levels_instruction():
    bare = synthetic_rows(0, "test", 3, "bare")
    assert bare[0]["prompt"] == [
        {"role": "user", "content": make_problem(0, "test", 0, "bare").question + " " + BARE_INSTRUCTION}
    ]
    assert bare[0]["reward_model"]["ground_truth"] == str(make_problem(0, "test", 0, "bare").result)
    easy = synthetic_rows(0, "test", 3, "easy")
    assert easy[0]["prompt"][0]["content"].endswith(GSM8K_INSTRUCTION)  # the word problems are unchanged
    served = load_spec("arith=synthetic-arith:bare", seed=0, synthetic_sizes={"test": 3})
    assert [row["prompt"] for row in served.splits["test"]] == [row["prompt"] for row in bare]
