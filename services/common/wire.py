"""Field types for wire models whose config is strict (no "3" for 3, no true for 1).

JSON Schema's `integer` admits 3.0 (a number with no fraction), and schema-driven clients send it;
pydantic's strict int refuses it. `JsonInt` takes exactly what the schema says: an integer, written
with or without ".0", never a string or a boolean.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]
