"""Reading a large /v1/rewards body without stalling the server: item by item, counting as it goes.

orjson parses 70 MB of small items in ~2 s and holds the GIL all that time, so even in a worker
thread it freezes the event loop (and /health) for every client; and it builds all 1e6 items before
anyone can count them. Here the envelope is walked with the standard library's JSON scanner, one
array element at a time: between elements the interpreter can switch threads, so the event loop
keeps running, and an `items` list longer than the limit is refused as soon as its limit+1-th item
is read, without building the rest.

The standard library accepts lone surrogates (`"\\ud800"`), which orjson refuses; the route checks
the strings it will echo (services.reward_server.app.check_sizes).
"""

from __future__ import annotations

import json
import re

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class TooManyItems(ValueError):
    def __init__(self, count: int) -> None:
        super().__init__(f"more than {count} items")
        self.count = count


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def peek(self) -> str:
        self.at = _SPACE.match(self.text, self.at).end()
        return self.text[self.at : self.at + 1]

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at char {self.at}")
        self.at += 1

    def value(self):
        self.peek()
        try:
            value, self.at = _DECODER.scan_once(self.text, self.at)
        except StopIteration:
            raise ValueError(f"expected a value at char {self.at}") from None
        return value

    def array(self, max_items: int) -> list:
        self.expect("[")
        values: list = []
        if self.peek() == "]":
            self.at += 1
            return values
        while True:
            values.append(self.value())
            if len(values) > max_items:
                raise TooManyItems(max_items)
            if self.peek() != ",":
                self.expect("]")
                return values
            self.at += 1


def load_rewards_body(body: bytes, max_items: int) -> dict:
    """The body as a dict (what json.loads would give); ValueError (json.JSONDecodeError or ours) if it
    is not a JSON object, TooManyItems as soon as `items` has more than `max_items` elements."""
    scanner = _Scanner(body.decode("utf-8"))
    scanner.expect("{")
    parsed: dict = {}
    if scanner.peek() == "}":
        scanner.at += 1
    else:
        while True:
            key = scanner.value()
            if not isinstance(key, str):
                raise ValueError(f"expected a key at char {scanner.at}")
            scanner.expect(":")
            parsed[key] = (
                scanner.array(max_items) if key == "items" and scanner.peek() == "[" else scanner.value()
            )
            if scanner.peek() != ",":
                scanner.expect("}")
                break
            scanner.at += 1
    if scanner.peek():
        raise ValueError(f"extra data at char {scanner.at}")
    return parsed
