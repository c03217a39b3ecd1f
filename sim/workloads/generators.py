"""Session generators for the three workload kinds, each a pure function of (seed, group index).

Group `i` of workload `w` depends only on (scenario seed, w, i), never on how many groups of
other workloads were drawn before, so the trainer's enqueue order cannot change what a session
is. Parameters come from the scenario (`sim.scenario` cites their sources).
"""

from __future__ import annotations

import numpy as np

from broker.session import SamplingParams, Session
from sim.scenario import AgenticSpec, LogNormal, RlhfSpec, RlvrSpec, Scenario
from sim.workloads.sampling import lognormal, lognormal_mixture, token_counts, truncate
from sim.workloads.truth import SessionTruth, SimSession, stable_hash, token_ids

_SYSTEM_PROMPT_TAG = 0x5157  # keeps system-prompt seeds apart from group seeds
_ADAPTER_TAG = 0x10A  # and the draw of a group's LoRA adapter


def _group_rng(seed: int, workload: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, stable_hash(workload), index])


def _final_latency(rng: np.random.Generator, spec: LogNormal | None) -> float:
    return float(lognormal(rng, spec, 1)[0]) if spec is not None else 0.0


def _token_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**62))


def _ids(workload: str, index: int, member: int) -> tuple[str, str]:
    group_id = f"{workload}-g{index:06d}"
    return group_id, f"{group_id}-{member:03d}"


def _member(spec: RlvrSpec | RlhfSpec | AgenticSpec, workload: str, index: int, member: int,
            prompt_ids: list[int], max_turns: int = 1, **metadata: int | str) -> Session:
    """Member `member` of group `index`: what the trainer enqueues (the truth is separate)."""
    group_id, session_id = _ids(workload, index, member)
    return Session(
        session_id=session_id,
        workload=workload,
        group_id=group_id,
        group_size=spec.group_size,
        prompt_token_ids=prompt_ids,
        max_tokens=spec.max_tokens,
        max_turns=max_turns,
        sampling=SamplingParams(temperature=spec.temperature),
        metadata={"group_index": index, **metadata},
    )


def _single_turn_group(
    workload: str,
    index: int,
    spec: RlvrSpec | RlhfSpec,
    prompt_ids: list[int],
    natural: list[int],
    rng: np.random.Generator,
    vocab_size: int,
) -> tuple[SimSession, ...]:
    out = []
    for member, n in enumerate(natural):
        lengths, truncated = truncate([n], spec.max_tokens)
        truth = SessionTruth(
            output_tokens=lengths,
            truncated=truncated,
            tool_latency_s=(),
            observation_tokens=(),
            final_latency_s=_final_latency(rng, spec.final_latency),
            token_seed=_token_seed(rng),
            vocab_size=vocab_size,
        )
        session = _member(spec, workload, index, member, prompt_ids)
        out.append(SimSession(session=session, truth=truth))
    return tuple(out)


def rlvr_group(spec: RlvrSpec, workload: str, seed: int, index: int, vocab_size: int) -> tuple[SimSession, ...]:
    """One GRPO group: n samples of one prompt; length = median × per-prompt × within-group factor."""
    rng = _group_rng(seed, workload, index)
    prompt_len = token_counts(lognormal(rng, spec.prompt, 1))[0]
    prompt_ids = token_ids((_token_seed(rng),), prompt_len, vocab_size)
    prompt_factor = np.exp(spec.prompt_sigma * rng.standard_normal())
    within = np.exp(spec.within_group_sigma * rng.standard_normal(spec.group_size))
    natural = token_counts(spec.output_median * prompt_factor * within)
    return _single_turn_group(workload, index, spec, prompt_ids, natural, rng, vocab_size)


def rlhf_group(spec: RlhfSpec, workload: str, seed: int, index: int, vocab_size: int) -> tuple[SimSession, ...]:
    """n responses to one chat prompt, lengths drawn independently."""
    rng = _group_rng(seed, workload, index)
    prompt_len = token_counts(lognormal(rng, spec.prompt, 1))[0]
    prompt_ids = token_ids((_token_seed(rng),), prompt_len, vocab_size)
    natural = token_counts(lognormal(rng, spec.output, spec.group_size))
    return _single_turn_group(workload, index, spec, prompt_ids, natural, rng, vocab_size)


def system_prompt(spec: AgenticSpec, workload: str, seed: int, family: int, vocab_size: int) -> list[int]:
    """The system prompt every episode of one task family starts with."""
    return token_ids((seed, stable_hash(workload), _SYSTEM_PROMPT_TAG, family), spec.system_prompt_tokens, vocab_size)


def _context_limited_turns(spec: AgenticSpec, prompt_len: int, outputs: tuple[int, ...], obs: list[int]) -> int:
    """How many turns fit: turn k runs only if its prompt + max_tokens ≤ max_context_tokens."""
    history = prompt_len
    for k in range(len(outputs)):
        if history + spec.max_tokens > spec.max_context_tokens:
            return k
        history += outputs[k] + (obs[k] if k < len(obs) else 0)
    return len(outputs)


def _agentic_truth(spec: AgenticSpec, rng: np.random.Generator, prompt_len: int, vocab_size: int) -> SessionTruth:
    turns = int(np.clip(np.rint(lognormal(rng, spec.turns, 1)[0]), spec.min_turns, spec.max_turns))
    outputs, truncated = truncate(token_counts(lognormal(rng, spec.output, turns)), spec.max_tokens)
    obs = token_counts(lognormal(rng, spec.observation, turns - 1))
    tools = lognormal_mixture(rng, spec.tool_latency, turns - 1).tolist()
    final = _final_latency(rng, spec.final_latency)
    kept = _context_limited_turns(spec, prompt_len, outputs, obs)
    return SessionTruth(
        output_tokens=outputs[:kept],
        truncated=truncated[:kept],
        tool_latency_s=tuple(tools[: kept - 1]),
        observation_tokens=tuple(obs[: kept - 1]),
        final_latency_s=final,
        token_seed=_token_seed(rng),
        vocab_size=vocab_size,
    )


def agentic_group(spec: AgenticSpec, workload: str, seed: int, index: int, vocab_size: int) -> tuple[SimSession, ...]:
    """n trajectories of one task: family system prompt + task prompt shared, episodes independent."""
    rng = _group_rng(seed, workload, index)
    family = int(rng.integers(0, spec.task_families))
    task_len = token_counts(lognormal(rng, spec.task_prompt, 1))[0]
    prompt_ids = system_prompt(spec, workload, seed, family, vocab_size) + token_ids(
        (_token_seed(rng),), task_len, vocab_size
    )
    out = []
    for member in range(spec.group_size):
        truth = _agentic_truth(spec, rng, len(prompt_ids), vocab_size)
        session = _member(spec, workload, index, member, prompt_ids, max_turns=spec.max_turns,
                          task_family=family, tool="sim")  # the simulated environment
        out.append(SimSession(session=session, truth=truth))
    return tuple(out)


def generate_group(scenario: Scenario, workload: str, index: int) -> tuple[SimSession, ...]:
    """Group `index` of `workload` in `scenario` (a pure function of its arguments)."""
    spec = scenario.workloads[workload]
    if isinstance(spec, RlvrSpec):
        make = rlvr_group
    elif isinstance(spec, RlhfSpec):
        make = rlhf_group
    else:
        make = agentic_group
    group = make(spec, workload, scenario.seed, index, scenario.vocab_size)
    if not spec.adapters:
        return group
    # A stream of its own, so the other draws are the same with or without adapters.
    k = int(np.random.default_rng([scenario.seed, stable_hash(workload), index,
                                   _ADAPTER_TAG]).integers(spec.adapters))
    return tuple(SimSession(session=s.session.model_copy(update={"adapter": f"{workload}-a{k}"}),
                            truth=s.truth, arrival_at=s.arrival_at) for s in group)
