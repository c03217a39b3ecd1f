"""What a finished session teaches the broker's predictors, in one place: the worker's stats
beyond the trainer's result (`CompletionStats`), the policy's `Completion` made of both
(`completion_of`), and its form on the capped completions stream, which lua/finish.lua writes
with the result and the broker reads with XREAD (`completion_json`, `completion_from_entry`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from broker.policies.base import Completion
from broker.session import SessionResult

# Completions a new broker recalls for its policy on taking the lease (`Policy.recall`):
# several windows (512 per workload) of the most recent, of the ~10,000 the capped completions
# stream keeps.
RECALL_COMPLETIONS = 4096


class CompletionStats(BaseModel):
    """What a finished session tells the broker's predictors beyond the trainer's result."""

    model_config = ConfigDict(extra="forbid")

    turn_output_tokens: list[int] = Field(default_factory=list)
    tool_wait_s: float = Field(default=0.0, ge=0.0)
    kv_token_seconds: float = Field(default=0.0, ge=0.0)
    truncated: bool = False


def completion_of(r: SessionResult, stats: CompletionStats) -> Completion:
    """What the policy learns from a finished session: its result and the worker's stats."""
    turns = stats.turn_output_tokens or ([r.output_tokens] if r.turns <= 1 else [])
    return Completion(
        session_id=r.session_id, workload=r.workload, backend_id=r.backend_id or "",
        prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        turn_output_tokens=tuple(int(t) for t in turns), turns=r.turns,
        tool_wait_s=float(stats.tool_wait_s), kv_token_seconds=float(stats.kv_token_seconds),
        admitted_at=r.admitted_at or 0.0, finished_at=r.finished_at or 0.0,
        truncated=bool(stats.truncated),
    )


def completion_json(c: Completion) -> str:
    """A completion as the completions stream carries it (`completion_from_entry` reads it)."""
    return json.dumps(dataclasses.asdict(c), separators=(",", ":"))


def completion_from_entry(fields: Mapping) -> Completion | None:
    """A completions-stream entry as a policy `Completion`; None if it cannot be read."""
    raw = fields.get(b"completion", fields.get("completion"))
    try:
        d = json.loads(raw)
        d["turn_output_tokens"] = tuple(int(t) for t in d["turn_output_tokens"])
        return Completion(**d)
    except (TypeError, ValueError, KeyError):
        return None
