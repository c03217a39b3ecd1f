"""Tools and scorers that misbehave on purpose, registered by key in tests/workers/tools.toml."""

from __future__ import annotations

import sys
import time
from pathlib import Path

TOOLS_TOML = Path(__file__).with_name("tools.toml")


def boom(call: dict) -> dict:
    raise ValueError(f"tool exploded on turn {call['turn']}")


def slow(call: dict) -> dict:
    time.sleep(30)
    return {"observation_token_ids": [1], "done": True}


def bad_scorer(call: dict) -> float:
    raise ZeroDivisionError("scorer divided by zero")


def exits(call: dict) -> dict:
    sys.exit(3)


def missing_checkpoint(update) -> None:
    """A weights hook (`--weights-hook tests.workers.tools_for_tests:missing_checkpoint`)."""
    raise FileNotFoundError(f"/ckpt/step-{update.version} does not exist")
