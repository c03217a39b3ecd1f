"""What only the simulated world knows about a session, kept apart from the public `Session`.

`SimSession` pairs the public `broker.session.Session` (what a trainer enqueues and a policy may
see) with its `SessionTruth` (true lengths and latencies). Nothing in `broker/` imports this
module, and the policy snapshot types have no field that could hold it.

Token ids are deterministic functions of a per-session seed, so an agentic follow-up prompt
(history + observation) is a real token sequence whose prefix the engine's cache can hit.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from broker.session import Session

# Streams of the per-session token RNG: distinct so output and observation ids never coincide.
_OUTPUT_STREAM = 1
_OBSERVATION_STREAM = 2


def stable_hash(text: str) -> int:
    """A process-independent 32-bit hash (Python's hash() is salted per process)."""
    return zlib.crc32(text.encode("utf-8"))


def token_ids(seed: tuple[int, ...], n: int, vocab_size: int) -> list[int]:
    """`n` token ids uniform in [0, vocab_size), a pure function of `seed`."""
    rng = np.random.default_rng(list(seed))
    return rng.integers(0, vocab_size, size=n, dtype=np.int64).tolist()


@dataclass(frozen=True, slots=True)
class SessionTruth:
    """True per-turn behaviour. Turn k's tool runs after turn k's output, before turn k+1.

    Invariants (checked on construction): at least one turn; `tool_latency_s` and
    `observation_tokens` have one entry per gap between turns (turns − 1); lengths ≥ 1 and
    `output_tokens[k]` already includes truncation at the session's `max_tokens`.
    """

    output_tokens: tuple[int, ...]  # tokens the model generates in each turn (≤ max_tokens)
    truncated: tuple[bool, ...]  # turn k stopped at max_tokens rather than at its natural end
    tool_latency_s: tuple[float, ...]  # seconds the tool runs after turn k, before turn k+1
    observation_tokens: tuple[int, ...]  # tokens the tool appends after turn k
    final_latency_s: float  # reward / test time after the last turn, before the result exists
    token_seed: int  # seeds this session's output and observation token ids
    vocab_size: int

    def __post_init__(self) -> None:
        turns = len(self.output_tokens)
        if turns < 1:
            raise ValueError("output_tokens: needs at least one turn")
        if len(self.truncated) != turns:
            raise ValueError(f"truncated: needs {turns} entries (one per turn)")
        for name in ("tool_latency_s", "observation_tokens"):
            if len(getattr(self, name)) != turns - 1:
                raise ValueError(f"{name}: needs {turns - 1} entries (one per gap between turns)")
        if any(n < 1 for n in self.output_tokens):
            raise ValueError("output_tokens: every turn generates at least 1 token")
        if any(n < 1 for n in self.observation_tokens):
            raise ValueError("observation_tokens: every observation has at least 1 token")
        if any(t < 0 for t in self.tool_latency_s) or self.final_latency_s < 0:
            raise ValueError("latencies must be ≥ 0 seconds")
        if self.vocab_size < 2:
            raise ValueError("vocab_size: must be ≥ 2")

    @property
    def turns(self) -> int:
        return len(self.output_tokens)

    def output_token_ids(self, turn: int) -> list[int]:
        """The ids the model emits in `turn` (for an engine that wants deterministic outputs)."""
        return token_ids((self.token_seed, _OUTPUT_STREAM, turn), self.output_tokens[turn], self.vocab_size)

    def observation_token_ids(self, turn: int) -> list[int]:
        """The ids the tool appends after `turn` (0 ≤ turn < turns − 1)."""
        return token_ids(
            (self.token_seed, _OBSERVATION_STREAM, turn), self.observation_tokens[turn], self.vocab_size
        )


@dataclass(frozen=True, slots=True)
class SimSession:
    """A session of the simulated world: public part, hidden truth, and when it arrives.

    `arrival_at` is None for generated sessions (the trainer enqueues them when its buffer has
    room) and a recorded time for sessions replayed from a trace with `arrival: recorded`.
    """

    session: Session
    truth: SessionTruth
    arrival_at: float | None = None

    def __post_init__(self) -> None:
        s, t = self.session, self.truth
        if not s.prompt_token_ids:
            raise ValueError("session.prompt_token_ids: simulated sessions need token ids")
        if t.turns > s.max_turns:
            raise ValueError(f"truth has {t.turns} turns but session.max_turns is {s.max_turns}")
        if max(t.output_tokens) > s.max_tokens:
            raise ValueError(f"truth.output_tokens exceed session.max_tokens ({s.max_tokens})")

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def workload(self) -> str:
        return self.session.workload

    def turn_prompt(self, turn: int, outputs: list[list[int]] | None = None) -> list[int]:
        """Turn `turn`'s prompt: the first prompt plus every earlier output and observation.

        `outputs[k]` are the ids the engine actually produced in turn k; by default the truth's
        deterministic `output_token_ids(k)`.
        """
        ids = list(self.session.prompt_token_ids or ())
        for k in range(turn):
            ids += outputs[k] if outputs is not None else self.truth.output_token_ids(k)
            ids += self.truth.observation_token_ids(k)
        return ids

    def turn_prompt_tokens(self, turn: int) -> int:
        """Length of `turn_prompt(turn)` without building it."""
        t = self.truth
        return len(self.session.prompt_token_ids or ()) + sum(t.output_tokens[:turn]) + sum(
            t.observation_tokens[:turn]
        )


def with_truth(sim: SimSession) -> Session:
    """The public session plus its simulated truth in metadata, for the simulated tool and
    engine (`sim_output_len`): what the live demo and benchmarks enqueue. Policies never see
    metadata; a real trainer sends none of this."""
    t = sim.truth
    meta = dict(sim.session.metadata)
    meta.update(tool="sim", reward="parity", sim_seed=t.token_seed, sim_turns=t.turns,
                sim_vocab=t.vocab_size,
                sim_output_tokens=",".join(map(str, t.output_tokens)),
                sim_tool_latency_s=",".join(f"{x:.4f}" for x in t.tool_latency_s),
                sim_observation_tokens=",".join(map(str, t.observation_tokens)),
                sim_final_latency_s=round(t.final_latency_s, 4))
    return sim.session.model_copy(update={"metadata": meta})
