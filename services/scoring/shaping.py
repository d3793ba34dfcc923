"""Optional reward shaping a user switches on per request: a format term and DAPO's overlong penalty.

Both are added to the scorer's score; neither changes `correct`.
"""

from __future__ import annotations


def format_term(well_formed: bool, bonus: float, penalty: float) -> float:
    """+bonus when the response has the scorer's answer format, -penalty when it has not."""
    return bonus if well_formed else -penalty


def overlong_penalty(response_length: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    0 up to `max_len - buffer_len` tokens, then falling linearly to `-penalty_factor` at `max_len`;
    held there beyond it (verl's DAPO manager never sees longer responses; we clip rather than extrapolate).
    With no buffer it is a step: the full penalty only beyond `max_len`.
    """
    expected_len = max_len - buffer_len
    exceed_len = response_length - expected_len
    if exceed_len <= 0:
        return 0.0
    return -penalty_factor * (min(exceed_len / buffer_len, 1.0) if buffer_len else 1.0)
