"""Code rewards: the response's program run against its test cases in the code-executor.

verl's code rows (codecontests, apps, codeforces, taco; its `sandbox_fusion` reward) carry their tests
in `reward_model.ground_truth`, a JSON string or an object:
  {"inputs": [...], "outputs": [...]}                 each case: stdin in, stdout compared
  {"inputs": [...], "outputs": [...], "fn_name": f}   call-based: each stdin line is one JSON argument of
                                                      f (or Solution().f); its result is printed
  {"assert_case": ["assert f(1) == 2", ...]}          each case appended to the program; it passes when
                                                      the program exits 0 (HumanEval rows: one case,
                                                      the problem's test and `check(entry_point)`)
As verl does: the program is the last ```python block (else the first ``` block, else there is none and
the score is 0); a case passes when the run succeeds and its stdout equals the expected output up to
trailing newlines (no expected output: success alone); the score is the pass rate of the first 10
cases (verl's `continuous=True` for these sources), and `correct` means every case passed.
`code_score="all_pass"` scores 1 only when every case passed. A case the sandbox could not run
(SandboxError) is the item's `error`, not the model's failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.code_executor.schemas import RunCodeRequest, RunCodeResponse, RunStatus

SCORED_CASES = 10  # verl's continuous score looks at the first 10 cases


@dataclass(frozen=True)
class Case:
    stdin: str | None
    expected: str | None
    appended: str = ""  # code after the program (an assert case)


@dataclass(frozen=True)
class CodeTests:
    cases: tuple[Case, ...]
    fn_name: str | None = None


def extract_code(response: str) -> str | None:
    """The program in a response: the last ```python block, else the first ``` block (without its
    language line), else None."""
    if "```python" in response:
        return response.split("```python")[-1].split("```")[0]
    parts = response.split("```")
    if len(parts) < 3:
        return None
    block = parts[1]
    first_line, newline, rest = block.partition("\n")
    return rest if newline and first_line.strip().isalpha() else block


def parse_tests(ground_truth) -> CodeTests:
    """The test cases of a code row; ValueError naming what is wrong with its shape."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            raise ValueError("code ground_truth must be JSON with inputs/outputs or assert_case") from None
    if not isinstance(ground_truth, dict):
        raise ValueError("code ground_truth must be an object with inputs/outputs or assert_case")
    asserts = ground_truth.get("assert_case")
    if isinstance(asserts, list) and asserts:
        inputs = ground_truth.get("inputs") or [None] * len(asserts)
        outputs = ground_truth.get("outputs") or [None] * len(asserts)
    else:
        inputs, outputs, asserts = ground_truth.get("inputs"), ground_truth.get("outputs"), None
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
            raise ValueError("code ground_truth needs non-empty inputs and outputs lists (or assert_case)")
    if len(inputs) != len(outputs) or (asserts is not None and len(asserts) != len(inputs)):
        raise ValueError("code ground_truth: inputs, outputs and assert_case differ in length")
    cases = tuple(
        Case(
            stdin=None if stdin is None else text_of(stdin),
            expected=None if expected is None else text_of(expected),
            appended="" if asserts is None else str(asserts[index]),
        )
        for index, (stdin, expected) in enumerate(zip(inputs, outputs))
    )
    fn_name = ground_truth.get("fn_name")
    return CodeTests(cases, fn_name if isinstance(fn_name, str) and fn_name else None)


def text_of(value) -> str:
    """A case's input or output as the program sees or prints it (verl: str() of the value)."""
    return value if isinstance(value, str) else str(value)


def call_program(code: str, fn_name: str) -> str:
    """A call-based case: the solution, then a driver that reads one JSON argument per stdin line,
    calls `fn_name` (a function, or a method of class Solution) and prints the result as verl's
    wrapper does (JSON for containers, None and booleans; str() otherwise)."""
    driver = f"""

def _case_main():
    import json, sys
    arguments = [json.loads(line) for line in sys.stdin.read().split("\\n") if line.strip()]
    target = globals().get({fn_name!r})
    if target is None and "Solution" in globals():
        target = getattr(globals()["Solution"](), {fn_name!r})
    if target is None:
        sys.exit("no function named " + {fn_name!r})
    result = target(*arguments)
    plain = isinstance(result, (dict, list, tuple, bool)) or result is None
    print(json.dumps(result) if plain else result)

_case_main()
"""
    return code + driver


def case_requests(code: str, tests: CodeTests, run_timeout_s: float, memory_mb: int) -> list[RunCodeRequest]:
    program = call_program(code, tests.fn_name) if tests.fn_name else code
    return [
        RunCodeRequest(
            code=program + ("\n\n" + case.appended if case.appended else ""),
            language="python",
            stdin=case.stdin,
            run_timeout=run_timeout_s,
            memory_limit_MB=memory_mb,
        )
        for case in tests.cases
    ]


def case_passed(case: Case, response: RunCodeResponse) -> bool:
    if response.status != RunStatus.Success or response.run_result is None:
        return False
    if case.expected is None:
        return True
    return (response.run_result.stdout or "").rstrip("\n") == case.expected.rstrip("\n")


def sandbox_failure(responses: list[RunCodeResponse]) -> str | None:
    """The first SandboxError's message: the case could not be judged, which is no fault of the model."""
    for response in responses:
        if response.status == RunStatus.SandboxError:
            return f"code-executor: {response.message or 'sandbox error'}"
    return None


def code_score(passed: list[bool], all_pass: bool) -> tuple[float, bool]:
    """(score, correct): the pass rate of the first SCORED_CASES cases, or 1/0 for all-pass."""
    correct = bool(passed) and all(passed)
    if all_pass:
        return float(correct), correct
    first = passed[:SCORED_CASES]
    return (sum(first) / len(first) if first else 0.0), correct
