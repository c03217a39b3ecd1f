"""Tools and scorers that misbehave on purpose (named by sessions as module:function)."""

from __future__ import annotations

import time


def boom(call: dict) -> dict:
    raise ValueError(f"tool exploded on turn {call['turn']}")


def slow(call: dict) -> dict:
    time.sleep(30)
    return {"observation_token_ids": [1], "done": True}


def bad_scorer(call: dict) -> float:
    raise ZeroDivisionError("scorer divided by zero")
