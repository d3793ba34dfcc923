"""`synthetic-arith`: seeded GSM8K-format word problems, generated from (seed, split, index) alone.

The project's offline default: no download, any size, a difficulty knob, and answers in GSM8K's own
format (worked steps with `<<a+b=c>>` notes, then `#### N`) so the same scorer and prompt apply.

- easy:   one addition or subtraction, numbers up to 20
- medium: two steps among + - x, numbers up to 50
- hard:   three steps among + - x /, numbers up to 500
- bare:   one addition or subtraction of numbers from 1 to 20, asked as a bare sum ("Compute 13 + 7.")
          with its own instruction, "Answer with a number only.", instead of GSM8K's step-by-step one.

`bare` is the CPU demo's task (jobgroup/demo.py): prompts of ~45 tokens and answers of ~10, so a GRPO
step costs seconds, and SmolLM2-135M-Instruct starts at about 35% greedy accuracy under the flexible
(last number) rule, with right and wrong samples in most groups, so GRPO has a signal from step 1.
The word problems take it 100+ tokens of rambling to reach ~6%.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Literal

Difficulty = Literal["easy", "medium", "hard"]

NAMES = [
    "Ava",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Vik",
    "Wren",
    "Yusuf",
]
OBJECTS = [
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "stamps",
    "shells",
    "books",
    "coins",
    "cards",
    "beads",
    "plums",
    "seeds",
    "blocks",
    "ribbons",
    "buttons",
]


@dataclass(frozen=True)
class Level:
    steps: int
    ops: str
    max_start: int
    max_operand: int
    bare: bool = False  # a bare sum answered with a number only, not a word problem


BARE_INSTRUCTION = "Answer with a number only."


LEVELS: dict[str, Level] = {
    "easy": Level(steps=1, ops="+-", max_start=20, max_operand=20),
    "medium": Level(steps=2, ops="+-*", max_start=50, max_operand=50),
    "hard": Level(steps=3, ops="+-*/", max_start=500, max_operand=500),
    "bare": Level(steps=1, ops="+-", max_start=20, max_operand=20, bare=True),
}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # GSM8K style: worked steps, then "#### N"
    result: int
    instruction: str | None = None  # what follows the question in the prompt; None: GSM8K's


def _pick_step(rng: random.Random, value: int, level: Level) -> tuple[str, int]:
    """An operation and operand that keep the running value a positive integer of sane size."""
    while True:
        op = rng.choice(level.ops)
        if op == "+":
            return op, rng.randint(1, level.max_operand)
        if op == "-" and value > 1:
            return op, rng.randint(1, value - 1)
        if op == "*" and value * 5 <= 10 * level.max_start:
            return op, rng.randint(2, 5)
        if op == "/":
            divisors = [d for d in range(2, 10) if value % d == 0]
            if divisors:
                return op, rng.choice(divisors)


def _apply(op: str, value: int, operand: int) -> int:
    return {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]


_PHRASES = {
    "+": "Then {who} gets {n} more.",
    "-": "Then {who} gives {n} away.",
    "*": "Then {who} ends up with {n} times as many as that.",
    "/": "Then {who} splits them into {n} equal piles and keeps just one pile.",
}
_SYMBOL = {"+": "+", "-": "-", "*": "*", "/": "/"}


def make_problem(seed: int, split: str, index: int, difficulty: Difficulty = "easy") -> Problem:
    level = LEVELS[difficulty]
    # crc32 keeps the stream stable across Python processes (hash() of a str is salted per process).
    rng = random.Random(zlib.crc32(f"{seed}|{split}|{difficulty}|{index}".encode()))
    if level.bare:
        return _bare_problem(rng, level)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.randint(2, level.max_start)
    sentences = [f"{name} has {value} {obj}."]
    work = []
    for _ in range(level.steps):
        op, operand = _pick_step(rng, value, level)
        new_value = _apply(op, value, operand)
        sentences.append(_PHRASES[op].format(who=name, n=operand))
        work.append(
            f"{value} {_SYMBOL[op]} {operand} = <<{value}{_SYMBOL[op]}{operand}={new_value}>>{new_value}"
        )
        value = new_value
    sentences.append(f"How many {obj} does {name} have now?")
    answer = "\n".join(work) + f"\n#### {value}"
    return Problem(question=" ".join(sentences), answer=answer, result=value)


def _bare_problem(rng: random.Random, level: Level) -> Problem:
    """a + b or a - b with a, b in 1..max; a difference is taken larger minus smaller (never negative)."""
    a, b = rng.randint(1, level.max_start), rng.randint(1, level.max_operand)
    op = rng.choice(level.ops)
    if op == "-" and b > a:
        a, b = b, a
    value = _apply(op, a, b)
    answer = f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}\n#### {value}"
    return Problem(
        question=f"Compute {a} {op} {b}.", answer=answer, result=value, instruction=BARE_INSTRUCTION
    )
