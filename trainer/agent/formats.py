"""How a model calls a tool, and how the result goes back into its context, as token ids.

Two formats, chosen by actor_rollout_ref.rollout.multi_turn.format:

search_r1  Search-R1 (Jin et al. 2025, github.com/PeterGriffinJin/Search-R1), for the search tool
           alone. The model writes `<search> query </search>` and generation stops there; the
           passages come back as `\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n` and the
           model goes on. A turn that closes `<answer> ... </answer>`, or ends without a search, ends
           the trajectory.
hermes     chat-template tool calls (Qwen2.5 / Qwen3 / NousResearch hermes) to any tool of the run,
           e.g. `<tool_call>{"name": "search", "arguments": {"query_list": [...]}}</tool_call>` or
           `<tool_call>{"name": "code_interpreter", "arguments": {"code": "..."}}</tool_call>`, in any
           turn. The results go back as `tool` messages rendered by the tokenizer's own chat
           template, and the template's generation prompt opens the next assistant turn.

A format only finds the calls (`parse`: the tool's name and arguments) and wraps the responses
(`observation`); each tool checks its own arguments and writes its own response text (search.py,
code.py), as verl's tools do.

Token in, token out: the loop never decodes and re-encodes the context. Template pieces are encoded
once here, each tool response once when it arrives. Tool responses are encoded with special tokens
split, so a passage or a program's output that contains `<|im_end|>` cannot close the turn.

Departures, each on purpose:
- A turn with no action (neither a tool call nor an answer) ends the trajectory, as in verl's agent
  loop; Search-R1 instead appends "My previous action is invalid..." and lets the model try again.
- A tool call the loop cannot run (broken JSON, unknown tool, bad arguments) gets a tool response that
  says why, and the trajectory goes on; verl drops a call whose JSON does not parse.
- max_tool_response_length counts tokens of each tool response (the issue asks for a token cap;
  verl counts characters). The truncation sides keep verl's meaning: `left` keeps the start and marks
  the cut at the end, `right` keeps the end, `middle` keeps both ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FormatName = Literal["search_r1", "hermes"]
TruncateSide = Literal["left", "right", "middle"]
ResultStatus = Literal["ok", "invalid", "failed"]

SEARCH_TOOL = "search"


@dataclass(frozen=True)
class ToolCall:
    """One call a model turn made: the tool and its arguments, or why it cannot run (told to the model)."""

    name: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)
    problem: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What one call gave the model to read, and how it went.

    ok: the tool ran (a program that raised is an ok run: its traceback is the result). invalid: the
    call could not run (the model's mistake: bad arguments, an unknown tool). failed: the tool itself
    failed (its service down after the client's retries, a sandbox error): the failure policy applies.
    """

    text: str
    status: ResultStatus = "ok"
    error: str | None = None  # failed: what went wrong, for the logs

    @classmethod
    def invalid(cls, problem: str) -> ToolResult:
        return cls(problem, "invalid")


class ToolFormat(Protocol):
    name: FormatName
    stop: tuple[str, ...]  # stop strings that end a model turn at a closed tool call

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls of one model turn's text; [] when the turn ends the trajectory."""
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

    def __init__(self, tokenizer, *, tool_name: str = SEARCH_TOOL) -> None:
        """tool_name: the search tool's name in the run's tool config (the tags call it)."""
        self.tool_name = tool_name
        self.open_ids = encode_template(tokenizer, "\n\n<information>")
        self.close_ids = encode_template(tokenizer, "</information>\n\n")

    def parse(self, text: str) -> list[ToolCall]:
        """The first closed action decides, as Search-R1's regex: a search goes on, an answer ends."""
        match = _SEARCH_R1_ACTION.search(text)
        if match is None or match.group(1) == "answer":
            return []
        query = match.group(2).strip()
        if not query:
            problem = "The search query is empty. Put the query between <search> and </search>."
            return [ToolCall(self.tool_name, problem=problem)]
        return [ToolCall(self.tool_name, {"query_list": [query]})]

    def observation(self, contents: Sequence[list[int]], turn_tail: str) -> list[int]:
        ids: list[int] = []
        for content in contents:
            ids += self.open_ids + content + self.close_ids
        return ids


# ------------------------------------------------------------------------------------------ hermes

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ASSISTANT_MARK = "@@ASSISTANT_TURN@@"


def tool_call_from_json(body: str, tool_names: Sequence[str]) -> ToolCall:
    """One `<tool_call>` body -> the tool and its arguments, or the problem the model is told about.
    The arguments are the tool's to check."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(problem=f"Error: the tool call is not valid JSON ({exc.msg}).")
    if not isinstance(call, dict) or "name" not in call:
        return ToolCall(problem='Error: a tool call needs {"name": ..., "arguments": {...}}.')
    if call["name"] not in tool_names:
        return ToolCall(problem=f"Error: unknown tool {call['name']!r}; the tools are {list(tool_names)}.")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], problem="Error: the tool call's arguments must be a JSON object.")
    return ToolCall(call["name"], arguments)


class HermesFormat:
    name: FormatName = "hermes"

    def __init__(
        self,
        tokenizer,
        *,
        max_parallel_calls: int = 1,
        tool_names: Sequence[str] = (SEARCH_TOOL,),
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
    ):
        """With one call per turn, generation stops at the closed call; with more, at the end of the
        assistant message (the model's own end-of-turn token, which it is then trained to write).
        chat_template, template_kwargs: the ones the prompts were rendered with (model.custom_chat_template,
        data.apply_chat_template_kwargs), so a turn after a tool's answer opens as the first did (Qwen3's
        enable_thinking=false adds its empty think block to every generation prompt)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.tool_names = tuple(tool_names)
        self.stop = ("</tool_call>",) if max_parallel_calls == 1 else ()
        self._pieces: dict[int, list[str]] = {}

    def parse(self, text: str) -> list[ToolCall]:
        return [tool_call_from_json(body.strip(), self.tool_names) for body in _TOOL_CALL.findall(text)]

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
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
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
    name: FormatName,
    tokenizer,
    *,
    max_parallel_calls: int = 1,
    tool_names: Sequence[str] = (SEARCH_TOOL,),
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> ToolFormat:
    """The format of multi_turn.format over the run's tools (search_r1: the search tool alone; hermes:
    the chat template's tool messages, rendered with the prompts' template and kwargs)."""
    if name == "search_r1":
        if len(tool_names) != 1:
            tools = list(tool_names)
            raise ValueError(f"multi_turn.format=search_r1 calls one tool, the search; the run has {tools}")
        return SearchR1Format(tokenizer, tool_name=tool_names[0])
    if name == "hermes":
        fmt = HermesFormat(
            tokenizer,
            max_parallel_calls=max_parallel_calls,
            tool_names=tool_names,
            chat_template=chat_template,
            template_kwargs=template_kwargs,
        )
        fmt.template_pieces(1)  # fail at start, not mid-rollout, on a template without tool messages
        return fmt
    raise ValueError(f"multi_turn.format must be search_r1 or hermes, not {name!r}")
