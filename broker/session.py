"""The rollout session: what a trainer enqueues, shared by the simulator and the live system.

A `Session` holds only what a real trainer knows when it enqueues: the prompt, caps and
sampling. Facts that only a simulated world knows (true output lengths, tool latencies,
observation lengths) live in `sim.workloads.SessionTruth`, which no policy snapshot can carry.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_WORKLOADS: tuple[str, ...] = ("rlvr", "rlhf", "agentic")

ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")  # session and group ids
WORKLOAD_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # workload names


class SessionState(StrEnum):
    pending = "pending"  # enqueued, waiting in its workload stream for admission
    admitted = "admitted"  # KV reserved on a backend, waiting in that backend's stream
    running = "running"  # a worker is running its turns on its engine
    done = "done"  # finished; exactly one result was published
    failed = "failed"  # gave up (engine errors, tool errors); a result with the reason was published
    cancelled = "cancelled"  # the trainer cancelled it before it finished


class SamplingParams(BaseModel):
    """The subset of vLLM's sampling parameters a rollout uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    ignore_eos: bool = False


class Session(BaseModel):
    """One rollout: a single-turn completion (rlvr, rlhf) or a multi-turn agentic episode.

    `max_tokens` caps each turn's output; `max_turns` caps an agentic episode (1 = single turn).
    Sessions sharing a `group_id` are one GRPO group (same prompt, n samples).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    workload: str
    group_id: str | None = None
    group_size: Annotated[int, Field(ge=1, le=1024)] = 1
    # Token ids are checked in pydantic-core (not a Python validator): the broker validates
    # every entry it reads, and a Python loop over each prompt was a tenth of its admission time.
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    prompt_text: str | None = None
    max_tokens: int
    max_turns: Annotated[int, Field(ge=1, le=1000)] = 1
    sampling: SamplingParams = SamplingParams()
    policy_version: Annotated[int, Field(ge=0)] = 0
    metadata: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("session_id", "group_id")
    @classmethod
    def _id_shape(cls, v: str | None) -> str | None:
        if v is not None and not ID_RE.match(v):
            raise ValueError("must be 1-128 characters of letters, digits, '_', '.', ':' or '-'")
        return v

    @field_validator("workload")
    @classmethod
    def _workload_shape(cls, v: str) -> str:
        if not WORKLOAD_RE.match(v):
            raise ValueError("must be a lowercase name of at most 32 characters")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be a positive number of tokens")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> Session:
        has_ids = bool(self.prompt_token_ids)
        has_text = bool(self.prompt_text)
        if has_ids == has_text:
            raise ValueError(
                "prompt: give exactly one non-empty prompt_token_ids or prompt_text"
            )
        return self

    @property
    def prompt_len_hint(self) -> int:
        """Prompt length in tokens (exact for token ids; ~4 chars/token estimate for text)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return max(1, len(self.prompt_text or "") // 4)


class SessionResult(BaseModel):
    """What the trainer reads back: exactly one per session."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    group_id: str | None = None
    status: SessionState
    backend_id: str | None = None
    turns: int = 0
    prompt_tokens: int = 0  # tokens of the first turn's prompt
    output_tokens: int = 0  # tokens the model generated, summed over turns
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, summed over turns
    output_token_ids: list[list[int]] = Field(default_factory=list)  # per turn
    reward: float | None = None
    error: str | None = None
    enqueued_at: float | None = None
    admitted_at: float | None = None
    finished_at: float | None = None
    policy_version: int = 0
