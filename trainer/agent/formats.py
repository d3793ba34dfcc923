"""How a model asks for a search, and how the result goes back into its context, as token ids.

Two formats, chosen by actor_rollout_ref.rollout.multi_turn.format:

search_r1  Search-R1 (Jin et al. 2025, github.com/PeterGriffinJin/Search-R1). The model writes
           `<search> query </search>` and generation stops there; the passages come back as
           `\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n` and the model goes on. A turn
           that closes `<answer> ... </answer>`, or ends without a search, ends the trajectory.
hermes     chat-template tool calls (Qwen2.5 / Qwen3 / NousResearch hermes), with the schema of verl's
           SearchTool: `<tool_call>{"name": "search", "arguments": {"query_list": [...]}}</tool_call>`.
           The results go back as `tool` messages rendered by the tokenizer's own chat template,
           with the content verl's SearchTool writes (`{"result": "Doc 1 (Title: ...)\\n..."}`), and
           the template's generation prompt opens the next assistant turn.

Token in, token out: the loop never decodes and re-encodes the context. A format turns the text of
one model turn into tool calls (`parse`), and the tool results into token ids that are appended
(`observation`): template pieces are encoded once here, each tool response once when it arrives.
Tool responses are encoded with special tokens split, so a passage that contains `<|im_end|>`
cannot close the turn.

Departures, each on purpose:
- A turn with no action (neither a search nor an answer) ends the trajectory, as in verl's agent loop;
  Search-R1 instead appends "My previous action is invalid..." and lets the model try again.
- A tool call the loop cannot run (empty query, broken JSON, unknown tool) gets a tool response that
  says why, and the trajectory goes on; verl drops a call whose JSON does not parse.
- max_tool_response_length counts tokens of each tool response (the issue asks for a token cap;
  verl counts characters). The truncation sides keep verl's meaning: `left` keeps the start and marks
  the cut at the end, `right` keeps the end, `middle` keeps both ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from services.retrieval_server.client import format_passages
from services.retrieval_server.schemas import Hit

FormatName = Literal["search_r1", "hermes"]
TruncateSide = Literal["left", "right", "middle"]

SEARCH_TOOL = "search"
# The OpenAI-style schema of verl's SearchTool; the chat template shows it to the model (hermes format).
SEARCH_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": SEARCH_TOOL,
        "description": "Searches Wikipedia for passages relevant to each query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "A list of fully-formed semantic queries. The tool returns passages for "
                    "each query.",
                }
            },
            "required": ["query_list"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    """One call a model turn made: the queries to search, or why it cannot run (told to the model)."""

    queries: tuple[str, ...] = ()
    problem: str | None = None


@dataclass(frozen=True)
class SearchOutcome:
    """What one call's search gave: passages per query, or the error after the retries ran out."""

    hits: list[list[Hit]] | None = None
    error: str | None = None


class ToolFormat(Protocol):
    name: FormatName
    stop: tuple[str, ...]  # stop strings that end a model turn at a closed tool call

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls of one model turn's text; [] when the turn ends the trajectory."""
        ...

    def result_text(self, call: ToolCall, outcome: SearchOutcome | None) -> str:
        """The tool response the model reads (outcome None: the call could not run)."""
        ...

    def observation(self, contents: Sequence[list[int]], turn_tail: str) -> list[int]:
        """Token ids appended after a model turn: the (truncated) tool responses with the format's
        wrapping. turn_tail: the decoded last token of the turn (with special tokens)."""
        ...


# ------------------------------------------------------------------------------------------ tokens


def encode_template(tokenizer, text: str) -> list[int]:
    """Template text: special tokens such as <|im_start|> become their ids."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_literal(tokenizer, text: str) -> list[int]:
    """Tool output: special-token strings in it are split into ordinary tokens, never control tokens."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


@dataclass(frozen=True)
class Truncation:
    """max_tool_response_length and tool_response_truncate_side, with the markers pre-encoded."""

    max_tokens: int
    side: TruncateSide
    head_marker: list[int]  # "...(truncated)" after the kept start (side left)
    tail_marker: list[int]  # "(truncated)..." before the kept end (side right)
    middle_marker: list[int]  # "...(truncated)..." between the kept ends (side middle)

    @classmethod
    def build(cls, tokenizer, max_tokens: int, side: TruncateSide) -> Truncation:
        if max_tokens < 1:
            raise ValueError(f"max_tool_response_length must be >= 1, got {max_tokens}")
        if side not in ("left", "right", "middle"):
            raise ValueError(f"tool_response_truncate_side must be left, right or middle, not {side!r}")
        return cls(
            max_tokens,
            side,
            encode_literal(tokenizer, "...(truncated)"),
            encode_literal(tokenizer, "(truncated)..."),
            encode_literal(tokenizer, "...(truncated)..."),
        )

    def apply(self, ids: list[int]) -> list[int]:
        """At most max_tokens of the response plus the marker where it was cut."""
        cap = self.max_tokens
        if len(ids) <= cap:
            return ids
        if self.side == "left":
            return ids[:cap] + self.head_marker
        if self.side == "right":
            return self.tail_marker + ids[-cap:]
        head = cap // 2
        return ids[:head] + self.middle_marker + ids[len(ids) - (cap - head) :]


# ------------------------------------------------------------------------------------------ Search-R1

_SEARCH_R1_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


class SearchR1Format:
    name: FormatName = "search_r1"
    stop = ("</search>", "</answer>")

    def __init__(self, tokenizer) -> None:
        self.open_ids = encode_template(tokenizer, "\n\n<information>")
        self.close_ids = encode_template(tokenizer, "</information>\n\n")

    def parse(self, text: str) -> list[ToolCall]:
        """The first closed action decides, as Search-R1's regex: a search goes on, an answer ends."""
        match = _SEARCH_R1_ACTION.search(text)
        if match is None or match.group(1) == "answer":
            return []
        query = match.group(2).strip()
        if not query:
            return [
                ToolCall(problem="The search query is empty. Put the query between <search> and </search>.")
            ]
        return [ToolCall((query,))]

    def result_text(self, call: ToolCall, outcome: SearchOutcome | None) -> str:
        if outcome is None:
            return call.problem or ""
        if outcome.error is not None:
            return f"The search failed ({outcome.error}). Search again or give your answer."
        return format_passages(outcome.hits[0]).strip() if outcome.hits and outcome.hits[0] else ""

    def observation(self, contents: Sequence[list[int]], turn_tail: str) -> list[int]:
        ids: list[int] = []
        for content in contents:
            ids += self.open_ids + content + self.close_ids
        return ids


# ------------------------------------------------------------------------------------------ hermes

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ASSISTANT_MARK = "@@ASSISTANT_TURN@@"


def verl_passages(hits: list[Hit]) -> str:
    """One query's passages as verl's SearchTool writes them: `Doc i (Title: t)\\ntext`, blank-line apart."""
    blocks = []
    for i, hit in enumerate(hits, start=1):
        title, _, text = hit.document.contents.partition("\n")
        blocks.append(f"Doc {i} (Title: {title})\n{text}")
    return "\n\n".join(blocks)


def tool_call_from_json(body: str, tool_names: Sequence[str]) -> ToolCall:
    """One `<tool_call>` body -> the queries, or the problem the model is told about."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(problem=f"Error: the tool call is not valid JSON ({exc.msg}).")
    if not isinstance(call, dict) or "name" not in call:
        return ToolCall(problem='Error: a tool call needs {"name": ..., "arguments": {...}}.')
    if call["name"] not in tool_names:
        return ToolCall(problem=f"Error: unknown tool {call['name']!r}; the tools are {list(tool_names)}.")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    queries = arguments.get("query_list") if isinstance(arguments, dict) else None
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) for q in queries):
        return ToolCall(problem="Error: 'query_list' is missing, empty, or not a list of strings.")
    queries = [q.strip() for q in queries]
    if not all(queries):
        return ToolCall(problem="Error: 'query_list' holds an empty query.")
    return ToolCall(tuple(queries))


class HermesFormat:
    name: FormatName = "hermes"

    def __init__(self, tokenizer, *, max_parallel_calls: int = 1, tool_names: Sequence[str] = (SEARCH_TOOL,)):
        """With one call per turn, generation stops at the closed call; with more, at the end of the
        assistant message (the model's own end-of-turn token, which it is then trained to write)."""
        self.tokenizer = tokenizer
        self.tool_names = tuple(tool_names)
        self.max_parallel_calls = max_parallel_calls
        self.stop = ("</tool_call>",) if max_parallel_calls == 1 else ()
        self._pieces: dict[int, list[str]] = {}

    def parse(self, text: str) -> list[ToolCall]:
        return [tool_call_from_json(body.strip(), self.tool_names) for body in _TOOL_CALL.findall(text)]

    def result_text(self, call: ToolCall, outcome: SearchOutcome | None) -> str:
        if outcome is None:
            result = call.problem or ""
        elif outcome.error is not None:
            result = f"Search error: {outcome.error}"
        elif not outcome.hits or not any(outcome.hits):
            result = "No search results found."
        else:
            result = "\n---\n".join(verl_passages(hits) for hits in outcome.hits)
        return json.dumps({"result": result}, ensure_ascii=False)

    def observation(self, contents: Sequence[list[int]], turn_tail: str) -> list[int]:
        pieces = self.template_pieces(len(contents))
        first = pieces[0]
        if turn_tail and first.startswith(turn_tail):  # the model already closed its turn itself
            first = first[len(turn_tail) :]
        ids = encode_template(self.tokenizer, first)
        for content, after in zip(contents, pieces[1:]):
            ids += content + encode_template(self.tokenizer, after)
        return ids

    def template_pieces(self, count: int) -> list[str]:
        """The chat template's text around `count` tool messages that follow an assistant turn:
        [close the turn + open tool 1, between tools..., close the last tool + generation prompt].

        Rendered once per count with placeholders, so any template that renders tool messages works;
        only the text after the assistant's content is used (templates render a last assistant turn
        differently from an earlier one, e.g. Qwen3's empty think block).
        """
        if count not in self._pieces:
            marks = [f"@@TOOL_RESPONSE_{i}@@" for i in range(count)]
            messages = [
                {"role": "user", "content": "question"},
                {"role": "assistant", "content": _ASSISTANT_MARK},
                *({"role": "tool", "content": mark} for mark in marks),
            ]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if _ASSISTANT_MARK not in text or not all(mark in text for mark in marks):
                raise ValueError(
                    "the tokenizer's chat template does not render tool messages; use "
                    "multi_turn.format=search_r1 or a template with tool support"
                )
            rest = text.split(_ASSISTANT_MARK, 1)[1]
            pieces = []
            for mark in marks:
                before, rest = rest.split(mark, 1)
                pieces.append(before)
            self._pieces[count] = [*pieces, rest]
        return self._pieces[count]


def make_format(
    name: FormatName, tokenizer, *, max_parallel_calls: int = 1, tool_names: Sequence[str] = (SEARCH_TOOL,)
) -> ToolFormat:
    if name == "search_r1":
        return SearchR1Format(tokenizer)
    if name == "hermes":
        fmt = HermesFormat(tokenizer, max_parallel_calls=max_parallel_calls, tool_names=tool_names)
        fmt.template_pieces(1)  # fail at start, not mid-rollout, on a template without tool messages
        return fmt
    raise ValueError(f"multi_turn.format must be search_r1 or hermes, not {name!r}")
