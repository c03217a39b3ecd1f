"""The rollout session: what a trainer enqueues, shared by the simulator and the live system.

A `Session` holds only what a real trainer knows when it enqueues: the prompt, caps and
sampling. Facts that only a simulated world knows (true output lengths, tool latencies,
observation lengths) live in `sim.workloads.SessionTruth`, which no policy snapshot can carry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

DEFAULT_WORKLOADS: tuple[str, ...] = ("rlvr", "rlhf", "agentic")
DEFAULT_MAX_ATTEMPTS = 3

ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")  # session and group ids
WORKLOAD_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # workload names
# Keys of the operator's tool and reward registry (workers/tools.py): a name, never code.
REGISTRY_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MODEL_RE = re.compile(r"^[!-~]{1,256}$")  # a served model's name: a path or hub id, no spaces

def check_adapter_name(name: object, field: str | None = None) -> None:
    """ValueError unless `name` can name a LoRA adapter (a registry key, as tools are); the
    message starts with `field: ` when given."""
    if not isinstance(name, str) or not REGISTRY_KEY_RE.match(name):
        raise ValueError(f"{field + ': ' if field else ''}{name!r} is not an adapter name "
                         "(1-64 letters, digits, '_', '.' or '-')")


# Strict scalars: JSON `true` is not a token id, `"10"` is not a number of tokens, and NaN or
# Infinity (which JSON cannot carry; they would be stored as null) is not a metadata value.
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MetadataValue = StrictStr | StrictBool | StrictInt | FiniteFloat


class SessionState(StrEnum):
    pending = "pending"  # enqueued, waiting in its workload stream for admission
    admitted = "admitted"  # KV reserved on a backend, waiting in that backend's stream
    running = "running"  # a worker is running its turns on its engine
    done = "done"  # finished; exactly one result was published
    failed = "failed"  # gave up (engine errors, tool errors); a result with the reason was published
    cancelled = "cancelled"  # the trainer cancelled it before it finished
    dead_lettered = "dead_lettered"  # its queue entry could not be read; moved to the dead-letter stream
    # An episode the agent drives (gateway/) that holds no KV: opened and not yet called, or
    # released after its agent idled; its next call asks for admission again.
    parked = "parked"


TERMINAL_STATES = frozenset({SessionState.done, SessionState.failed, SessionState.cancelled,
                             SessionState.dead_lettered})


StopString = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class SamplingParams(BaseModel):
    """The subset of vLLM's sampling parameters a rollout uses, with vLLM's names and meanings.

    `logprobs` asks the engine for the logprob of every sampled token (vLLM's `logprobs: 0`);
    they come back per turn in `TurnRecord.output_logprobs`, where importance-sampling
    corrections need them. There is no `n`: a session is one sample, and n samples of one
    prompt are a GRPO group (`group_size` sessions sharing a `group_id`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # 0 or -1: off
    min_p: Annotated[FiniteFloat, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[FiniteFloat, Field(gt=0.0, le=10.0)] = 1.0
    stop: Annotated[list[StopString], Field(max_length=16)] = Field(default_factory=list)
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                              Field(max_length=64)] = Field(default_factory=list)
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    logprobs: StrictBool = True


class TurnRecord(BaseModel):
    """One turn of a session, as a trainer trains on it.

    `input_token_ids` are the tokens that entered the context before this turn's output: the
    prompt (turn 0, as the engine tokenized it) or the tool's observation after the previous
    turn. The session's whole token sequence is every record's input then output, in order.
    `policy_version` is the version of the weights that generated `output_token_ids`: a turn
    cut by a weight update (`pause(mode="abort")`) goes on after it from what it had, as a
    second record of the same `turn` with no input tokens and the new version. A request frozen
    by `pause(mode="keep")` is split the same way where the engine's weights changed (its first
    record has no finish reason: the request had not finished there).
    """

    model_config = ConfigDict(extra="forbid")

    turn: int
    input_token_ids: list[int] = Field(default_factory=list)
    output_token_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] | None = None  # one per output token; None when not requested
    finish_reason: str | None = None  # the engine's: "stop" (EOS or a stop condition), "length"
    policy_version: int = 0

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> TurnRecord:
        if self.output_logprobs is not None and len(self.output_logprobs) != len(
                self.output_token_ids):
            raise ValueError(f"output_logprobs: {len(self.output_logprobs)} logprobs for "
                             f"{len(self.output_token_ids)} output tokens")
        return self


class PartialRollout(BaseModel):
    """What a session had generated when its worker drained: it goes on from here on another
    worker, generating nothing twice. `history_token_ids` is the context to continue from
    (prompt, outputs and observations so far, the cut turn's partial output included);
    `turn` the turn to continue, of which `turn_output_tokens` are in `turn_records`; and
    `next_input_token_ids` the observation that entered the context but is in no record yet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    turn_records: list[TurnRecord]
    history_token_ids: list[Annotated[StrictInt, Field(ge=0)]]
    turn: Annotated[StrictInt, Field(ge=0)]
    turn_output_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    next_input_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list)


class Session(BaseModel):
    """One rollout: a single-turn completion (rlvr, rlhf) or a multi-turn agentic episode.

    `max_tokens` caps each turn's output; `max_turns` caps an agentic episode (1 = single turn).
    `driver` says who runs the turns: a worker (`"worker"`, with the registered tool between
    them), or the agent's own code calling the session gateway (`"agent"`: an episode opened
    with `RolloutClient.open_episode`; broker/episodes.py), which needs no tool.
    Sessions sharing a `group_id` are one GRPO group (same prompt, n samples).
    `metadata.tool` and `metadata.reward` name the session's tool and reward scorer by their
    key in the operator's registry (`workers/tools.py`); a multi-turn session must name a tool,
    and one naming no reward gets none. `max_attempts` bounds how often the session may start
    on an engine: an engine or worker that dies mid-session hands it back to be run again, and
    the attempt that would exceed this ends it `failed`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: StrictStr
    workload: StrictStr
    group_id: StrictStr | None = None
    group_size: Annotated[StrictInt, Field(ge=1, le=1024)] = 1
    # Token ids are checked in pydantic-core (not a Python validator): the broker validates
    # every entry it reads, and a Python loop over each prompt was a tenth of its admission time.
    prompt_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    prompt_text: StrictStr | None = None
    max_tokens: StrictInt
    max_turns: Annotated[StrictInt, Field(ge=1, le=1000)] = 1
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    policy_version: Annotated[StrictInt, Field(ge=0)] = 0
    # Past the namespace's staleness bound before it is admitted (broker/weights.py): end
    # failed, or run on the weights the engines serve then.
    on_stale: Literal["fail", "refresh"] = "fail"
    max_attempts: Annotated[StrictInt, Field(ge=1, le=100)] = DEFAULT_MAX_ATTEMPTS
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    # Set by a worker that drained while the session ran (workers/runner.py): go on from it.
    resume_from: PartialRollout | None = None
    driver: Literal["worker", "agent"] = "worker"
    # The served model the session needs (vLLM's `--served-model-name`, by default the model
    # path); None: whichever model the namespace's engines serve.
    model: StrictStr | None = None
    # A LoRA adapter registered in the namespace (`RolloutClient.register_adapter`): the
    # session's every request runs with it, on an engine started with `--enable-lora`.
    adapter: StrictStr | None = None

    @field_validator("session_id", "group_id")
    @classmethod
    def _id_shape(cls, v: str | None) -> str | None:
        if v is not None and not ID_RE.match(v):
            raise ValueError("must be 1-128 characters of letters, digits, '_', '.', ':' or '-'")
        return v

    @field_validator("model")
    @classmethod
    def _model_shape(cls, v: str | None) -> str | None:
        if v is not None and not MODEL_RE.match(v):
            raise ValueError("must be 1-256 printable characters without spaces")
        return v

    @field_validator("adapter")
    @classmethod
    def _adapter_shape(cls, v: str | None) -> str | None:
        if v is not None:
            check_adapter_name(v)
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

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_values(cls, v: object) -> object:
        """Name the key at fault ("x: ...") instead of the union's member ("x.str: ...")."""
        if not isinstance(v, dict):
            return v
        for key, value in v.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key}: {value} is not a finite number")
            if not isinstance(value, str | int | float | bool):
                raise ValueError(f"{key}: must be a string, number or boolean, "
                                 f"not {type(value).__name__}")
        for key in ("tool", "reward"):
            name = v.get(key)
            if name is not None and not (isinstance(name, str) and REGISTRY_KEY_RE.match(name)):
                raise ValueError(f"{key}: {name!r} is not a registry key (1-64 letters, digits, "
                                 "'_', '.' or '-'); name a tool or reward the operator registered")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> Session:
        has_ids = bool(self.prompt_token_ids)
        has_text = bool(self.prompt_text)
        if has_ids == has_text:
            raise ValueError(
                "prompt: give exactly one non-empty prompt_token_ids or prompt_text"
            )
        if self.max_turns > 1 and self.driver == "worker" and "tool" not in self.metadata:
            raise ValueError(f"metadata.tool: a session of max_turns {self.max_turns} needs a "
                             "tool for the observations between its turns; name one")
        return self

    @property
    def tool(self) -> str | None:
        """The registry key of the session's tool (None: single-turn, no tool)."""
        name = self.metadata.get("tool")
        return name if isinstance(name, str) else None

    @property
    def reward(self) -> str | None:
        """The registry key of the session's reward scorer (None: no reward is computed)."""
        name = self.metadata.get("reward")
        return name if isinstance(name, str) else None

    @property
    def prompt_len_hint(self) -> int:
        """Tokens the session's next request starts from: its prompt (exact for token ids;
        ~4 chars/token for text), or for a resumed session the context it goes on from."""
        if self.resume_from is not None:
            return len(self.resume_from.history_token_ids)
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return max(1, len(self.prompt_text or "") // 4)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A session as one token sequence: `loss_mask` is 1 on tokens the model generated and 0 on
    prompt and observation tokens; `logprobs` and `policy_versions` hold the sampled token's
    logprob and the weights' version on model tokens (0.0 and -1 elsewhere, and logprobs 0.0
    where none were requested)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]


class SessionResult(BaseModel):
    """What the trainer reads back: exactly one per session. `turn_records` hold its tokens
    turn by turn; `trajectory()` lays them out as one sequence with a loss mask."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    group_id: str | None = None
    group_size: int = 1
    status: SessionState
    backend_id: str | None = None
    turns: int = 0
    prompt_tokens: int = 0  # tokens of the first turn's prompt
    output_tokens: int = 0  # tokens the model generated, summed over turns
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, summed over turns
    turn_records: list[TurnRecord] = Field(default_factory=list)
    reward: float | None = None
    error: str | None = None
    enqueued_at: float | None = None
    admitted_at: float | None = None
    finished_at: float | None = None
    policy_version: int = 0  # the session's, as enqueued
    # Set by the client when it hands the result over: its oldest tokens are more than the
    # namespace's staleness bound behind the policy version the engines serve.
    stale: bool = False

    @property
    def oldest_version(self) -> int:
        """The oldest policy version behind any of its tokens (its own, when it has none)."""
        return min((t.policy_version for t in self.turn_records), default=self.policy_version)

    @property
    def output_token_ids(self) -> list[list[int]]:
        """The generated ids of each turn (a turn interrupted by a weight update has one
        record per policy version; they are joined here)."""
        turns: list[list[int]] = []
        last = None
        for t in self.turn_records:
            if t.turn != last:
                turns.append([])
                last = t.turn
            turns[-1].extend(t.output_token_ids)
        return turns

    def trajectory(self) -> Trajectory:
        tokens: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for t in self.turn_records:
            n_in, n_out = len(t.input_token_ids), len(t.output_token_ids)
            tokens += t.input_token_ids
            tokens += t.output_token_ids
            mask += [0] * n_in + [1] * n_out
            logprobs += [0.0] * n_in
            logprobs += t.output_logprobs if t.output_logprobs is not None else [0.0] * n_out
            versions += [-1] * n_in + [t.policy_version] * n_out
        return Trajectory(tokens, mask, logprobs, versions)
