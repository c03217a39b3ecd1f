"""A fluid upper bound on a scenario's rollout throughput, from the engine's own cost model.

No policy can beat it on the scenario's sessions and engines, because it grants every favour
at once:
- every engine decodes a full batch all the time: S sequences, as many as its KV holds at
  the sessions' mean context less the prompt blocks they share with other sessions (a shared
  block is held once, as if every session sharing it ran on the same engine), or
  `max_num_seqs`, or the trainer's in-flight bound shared over the engines, whichever is
  fewer;
- nothing is ever preempted or recomputed, and prefix reuse is perfect: the only tokens ever
  prefilled are the distinct prompt blocks of all sessions (a GRPO group's prompt once, a
  shared system prompt once) and the tool observations; a session's own earlier turns are
  always still cached;
- tool waits, reward time and the trainer's own pace cost nothing.

With the step-time model of `sim/engine/profiles.py`, one output token then costs an engine

    τ = t0/S + t_seq + L(S)/S + b·C̄ + (a·U + c·P)/O

seconds, where L is the linear-layer time of a step (a·N for a dense model; for a mixture of
experts also the expert weights a step streams), C̄ the token-weighted mean context a decode
step reads, O the output tokens, U the prefill tokens and P the prefill (query, key) pairs of
the sampled sessions (prefill runs in full chunks, where L(N) ≈ a·N). The bound is engines/τ
generated tokens per second, the same unit as the bench's tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sim.engine.profiles import get_profile
from sim.scenario import Scenario
from sim.workloads.source import make_source
from sim.workloads.truth import SimSession

BLOCK = 16  # tokens per KV block: prefix reuse is counted in whole blocks, as vLLM does


@dataclass(frozen=True, slots=True)
class FluidBound:
    tokens_per_s: float  # the bound, fleet-wide
    seqs_per_engine: float  # S: the batch each engine decodes
    limited_by: str  # what caps S: 'kv', 'max_num_seqs' or 'inflight_bound'
    mean_context: float  # C̄, tokens
    mean_kv_context: float  # the KV each sequence holds on average (C̄ less shared prompt blocks)
    prefill_per_output: float  # U/O: prefill tokens per output token
    sessions_sampled: int


def sample_sessions(scenario: Scenario, scenario_path: str | Path, n: int) -> list[SimSession]:
    """About `n` sessions in the trainer's mixture proportions (whole groups, the trainer's
    order of preference: the workload furthest below its share next)."""
    source = make_source(scenario, scenario_path)
    taken = {w: 0 for w, p in scenario.mixture.items() if p > 0}
    out: list[SimSession] = []
    exhausted: set[str] = set()
    while len(out) < n and len(exhausted) < len(taken):
        w = min((w for w in taken if w not in exhausted),
                key=lambda w: (taken[w] / scenario.mixture[w], w))
        group = source.next_group(w)
        if group is None:
            exhausted.add(w)
            continue
        taken[w] += len(group)
        out.extend(group)
    return out


def _prompt_blocks(prompts: list[list[int]]) -> tuple[int, float, list[int]]:
    """Distinct prompt tokens across all prompts, in whole blocks of shared prefix (a block is
    the same when it and everything before it are), their prefill (query, key) pairs, and per
    prompt the tokens of its blocks that another prompt shares."""
    chains: list[list[tuple[int, int, int]]] = []  # per prompt: (block hash, start, length)
    count: dict[int, int] = {}
    for prompt in prompts:
        h = 0
        chain = []
        for start in range(0, len(prompt), BLOCK):
            block = tuple(prompt[start:start + BLOCK])
            h = hash((h, block))
            chain.append((h, start, len(block)))
            count[h] = count.get(h, 0) + 1
        chains.append(chain)
    seen: set[int] = set()
    tokens = 0
    pairs = 0.0
    shared: list[int] = []
    for chain in chains:
        mine = 0
        for h, start, n in chain:
            if count[h] > 1:
                mine += n
            if h in seen:
                continue
            seen.add(h)
            tokens += n
            pairs += n * (start + n / 2)
        shared.append(mine)
    return tokens, pairs, shared


def fluid_bound(scenario: Scenario, scenario_path: str | Path, samples: int = 2_000) -> FluidBound:
    sessions = sample_sessions(scenario, scenario_path, samples)
    if not sessions:
        raise ValueError("bound: the scenario yields no sessions")
    profile = (get_profile(scenario.fleet.profile).with_kv_tokens(scenario.fleet.kv_tokens)
               .with_limits(scenario.fleet.max_num_seqs, scenario.fleet.max_num_batched_tokens))
    prompt_tokens, prompt_pairs, shared = _prompt_blocks(
        [list(s.session.prompt_token_ids or ()) for s in sessions])
    outputs = 0
    ctx_weight = 0.0  # Σ over output tokens of the context the step that made it read
    kv_weight = 0.0  # the same without prompt blocks another session shares (held once)
    obs_tokens = 0
    obs_pairs = 0.0
    for s, own_shared in zip(sessions, shared):
        history = len(s.session.prompt_token_ids or ())
        truth = s.truth
        for k, out in enumerate(truth.output_tokens):
            outputs += out
            ctx_weight += out * history + out * (out - 1) / 2
            kv_weight += out * (history - own_shared) + out * (out - 1) / 2
            history += out
            if k < len(truth.observation_tokens):
                ob = truth.observation_tokens[k]
                obs_tokens += ob
                obs_pairs += ob * (history + ob / 2)
                history += ob
    mean_ctx = ctx_weight / outputs
    # KV holds a shared prompt block once for every sequence that reads it: at best (all
    # sharers on one engine) a sequence's KV is its context less its shared prompt blocks.
    mean_kv = kv_weight / outputs
    caps = {"kv": profile.kv_tokens / max(mean_kv, 1.0),
            "max_num_seqs": float(profile.max_num_seqs),
            "inflight_bound": scenario.trainer.inflight_bound / scenario.fleet.engines}
    limited_by = min(caps, key=caps.get)
    seqs = max(1.0, caps[limited_by])
    p = profile
    prefill_tokens = prompt_tokens + obs_tokens
    batch = max(1, int(seqs))
    tau = (p.t0 / seqs + p.t_seq + p.linear_time(batch) / batch + p.b * mean_ctx
           + (p.a * prefill_tokens + p.c * (prompt_pairs + obs_pairs)) / outputs)
    return FluidBound(tokens_per_s=scenario.fleet.engines / tau, seqs_per_engine=seqs,
                      limited_by=limited_by, mean_context=mean_ctx, mean_kv_context=mean_kv,
                      prefill_per_output=prefill_tokens / outputs,
                      sessions_sampled=len(sessions))
