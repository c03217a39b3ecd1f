"""JSONL session traces: one simulated session per line, replayable by a `source: trace` scenario.

Line format (version 1), keys in this order:
    {"v": 1, "arrival_at": 12.5 | null, "session": {<broker.session.Session fields>},
     "truth": {"output_tokens": [...], "truncated": [...], "tool_latency_s": [...],
               "observation_tokens": [...], "final_latency_s": 0.0, "token_seed": 7,
               "vocab_size": 151936}}
`arrival_at` is when the trainer enqueued it (null: whenever the trainer's buffer has room).
Floats are written with Python's shortest round-trip repr, so read(write(x)) == x exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.session import Session
from sim.workloads.truth import SessionTruth, SimSession

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the file, line, field and reason."""


class _TruthRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output_tokens: list[int]
    truncated: list[bool]
    tool_latency_s: list[float]
    observation_tokens: list[int]
    final_latency_s: float
    token_seed: Annotated[int, Field(ge=0)]
    vocab_size: int


class _TraceLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: Literal[1]
    arrival_at: Annotated[float, Field(ge=0.0)] | None
    session: Session
    truth: _TruthRecord


def _line(s: SimSession) -> str:
    record = {
        "v": TRACE_VERSION,
        "arrival_at": s.arrival_at,
        "session": s.session.model_dump(mode="json"),
        "truth": dataclasses.asdict(s.truth),  # its fields, in order; tuples become lists
    }
    return json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def write_trace(path: str | Path, sessions: Iterable[SimSession]) -> int:
    """Write one line per session; returns how many were written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for s in sessions:
            f.write(_line(s) + "\n")
            count += 1
    return count


def with_arrivals(sessions: Iterable[SimSession], enqueued_at: Mapping[str, float]) -> list[SimSession]:
    """Stamp each session with the time a run enqueued it, to export that run as a trace."""
    return [dataclasses.replace(s, arrival_at=enqueued_at[s.session_id]) for s in sessions]


def _parse(text: str) -> SimSession:
    raw = json.loads(text)
    line = _TraceLine.model_validate(raw)
    t = line.truth
    try:
        truth = _truth(t)
    except ValueError as exc:
        raise ValueError(f"truth.{exc}") from None
    return SimSession(session=line.session, truth=truth, arrival_at=line.arrival_at)


def _truth(t: _TruthRecord) -> SessionTruth:
    return SessionTruth(
        output_tokens=tuple(t.output_tokens),
        truncated=tuple(t.truncated),
        tool_latency_s=tuple(t.tool_latency_s),
        observation_tokens=tuple(t.observation_tokens),
        final_latency_s=t.final_latency_s,
        token_seed=t.token_seed,
        vocab_size=t.vocab_size,
    )


def read_trace(path: str | Path) -> list[SimSession]:
    """Every session of a trace, in file order. Blank lines are skipped; ids must be unique."""
    path = Path(path)
    out: list[SimSession] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                s = _parse(text)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                reason = str(err["msg"]).removeprefix("Value error, ")
                raise TraceError(f"{where}: {field}: {reason}") from None
            except ValueError as exc:
                raise TraceError(f"{where}: {exc}") from None
            if s.session_id in seen:
                raise TraceError(f"{where}: session.session_id: duplicate {s.session_id!r}")
            seen.add(s.session_id)
            out.append(s)
    return out
