"""A fluid upper bound on a scenario's rollout throughput, from the engine's own cost model.

No policy can beat it on the scenario's sessions and engines: it grants every favour a policy
could hope for, and charges only what no policy can avoid. docs/misa-t.md ("The fluid bound")
derives each term; in short, per engine, with S sequences decoding in every step:

- **Compute.** One output token costs

      τ_c(S) = t0/S + t_seq + max(L(S)/S, a·(1 + U/O)) + b·C̄ + (c·P)/O + R/O

  seconds of engine time: L is the linear-layer time of a step (a·N for a dense model; for a
  mixture of experts also the expert weights a step streams), so a step's S decode tokens cost
  at least L(S), and all tokens together at least a per token, however the prefill rides along
  (on a mixture of experts a prefill chunk in a decode step costs little more than the experts
  the step streams anyway). C̄ is the token-weighted mean context a decode step reads, O the
  output tokens, U the prefill tokens (distinct prompt blocks, once: a GRPO group's prompt, a
  shared system prompt; every tool observation), P their prefill (query, key) pairs, R the
  re-prefill of the agentic histories not kept in KV over a tool wait (below).
- **KV.** KV·seconds per output token are at most C·τ: the decoding batch holds S·k̄ tokens
  (k̄: a sequence's mean context less the prompt blocks it shares with other sessions, held
  once) for the S·τ_c of a step, and an agentic history kept over a tool wait holds its own
  tokens H for the wait W. A history not kept is re-prefilled when the tool returns (its
  prefill joins R). Each wait is kept or not, whichever serves the bound best: the waits
  cheapest to keep per second of re-prefill saved are kept first (a fractional knapsack).
- **The trainer's sessions in flight** (Little's law). Per output token a session is in flight
  S·τ_c seconds on the engine and w seconds outside it (its tool waits and the reward's
  latency after its last turn): (S·τ_c + w)/τ ≤ the in-flight bound per engine.
- **Nothing else costs anything**: no preemption, no queueing, perfect prefix reuse of every
  prompt block, every session's own history in KV whenever it was kept.

τ(S) is the largest of the three times, minimised over S (1 … max_num_seqs) and the waits kept;
the bound is engines/τ generated tokens per second, the bench's unit. A sync trainer (one whole
step at a time) adds the step's barrier: a step lasts at least its fluid work at that rate and
at least its slowest session's own path (every token a step of its own at batch 1, plus its tool
waits and reward latency), and the trainer's `train_s` between steps idles the fleet. An async
run ends with up to its in-flight bound of sessions still out, at best the slowest: the sample
leaves that share of the slowest out (a short run finishes a biased share of quick sessions).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.engine.profiles import EngineProfile, get_profile
from sim.metrics import quotas, sync_step
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
    prefill_per_output: float  # U/O: prefill tokens per output token (histories not kept: apart)
    sessions_sampled: int
    waits_kept: float  # share of the agentic tool waits whose history stays in KV (1 with none)
    outside_per_output: float  # w: seconds a session is in flight off the engine per output token
    barrier_share: float  # sync: share of the steps' time that their slowest sessions add (else 0)


@dataclass(frozen=True, slots=True)
class _Work:
    """What the sampled sessions ask of the fleet, summed."""

    outputs: float  # O
    ctx_weight: float  # Σ over output tokens of the context the step that made it read
    kv_weight: float  # the same without prompt blocks another session shares
    prefill_tokens: float  # U
    prefill_pairs: float  # P
    outside_s: float  # Σ tool waits + reward latencies (session-seconds off the engine)
    keep_kv_s: np.ndarray  # per tool wait: KV·s of keeping the history over it
    reprefill_s: np.ndarray  # per tool wait: engine seconds of re-prefilling it instead


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


def sync_steps(scenario: Scenario, scenario_path: str | Path) -> list[list[SimSession]]:
    """The sessions of each step of a sync trainer, as `sim.metrics.Trainer` enqueues them:
    whole groups until each workload holds its quota of the batch."""
    source = make_source(scenario, scenario_path)
    quota = quotas(scenario.trainer.batch_size, scenario.mixture)
    steps: list[list[SimSession]] = []
    for _ in range(scenario.trainer.iterations):
        step = sync_step(source.next_group, quota)
        if not step:
            break
        steps.append(step)
    return steps


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


def _work(sessions: list[SimSession], p: EngineProfile) -> _Work:
    prompt_tokens, prompt_pairs, shared = _prompt_blocks(
        [list(s.session.prompt_token_ids or ()) for s in sessions])
    outputs = 0
    ctx_weight = kv_weight = 0.0
    obs_tokens = 0
    obs_pairs = outside = 0.0
    keep: list[float] = []
    reprefill: list[float] = []
    for s, own_shared in zip(sessions, shared):
        history = len(s.session.prompt_token_ids or ())
        truth = s.truth
        outside += truth.final_latency_s + sum(truth.tool_latency_s)
        for k, out in enumerate(truth.output_tokens):
            outputs += out
            read = out * history + out * (out - 1) / 2
            ctx_weight += read
            kv_weight += read - out * own_shared
            history += out
            if k < len(truth.observation_tokens):
                # Over the tool wait the history either stays in KV (its own tokens, for the
                # wait) or is prefilled again when the tool returns (positions own_shared…).
                own = history - own_shared
                keep.append(own * truth.tool_latency_s[k])
                reprefill.append(p.a * own + p.c * own * (own_shared + own / 2))
                ob = truth.observation_tokens[k]
                obs_tokens += ob
                obs_pairs += ob * (history + ob / 2)
                history += ob
    return _Work(outputs=float(outputs), ctx_weight=ctx_weight, kv_weight=kv_weight,
                 prefill_tokens=float(prompt_tokens + obs_tokens),
                 prefill_pairs=prompt_pairs + obs_pairs, outside_s=outside,
                 keep_kv_s=np.asarray(keep, dtype=float),
                 reprefill_s=np.asarray(reprefill, dtype=float))


def _path_s(s: SimSession, p: EngineProfile) -> float:
    """The shortest a session can take from its first token to its result: every token a
    step of its own at batch 1, then its tool waits and the reward's latency."""
    truth = s.truth
    path = truth.final_latency_s + sum(truth.tool_latency_s)
    history = len(s.session.prompt_token_ids or ())
    for k, out in enumerate(truth.output_tokens):
        path += out * (p.t0 + p.t_seq + p.linear_time(1)) + p.b * (out * history + out * (out - 1) / 2)
        history += out + (truth.observation_tokens[k] if k < len(truth.observation_tokens) else 0)
    return path


@dataclass(frozen=True, slots=True)
class _Best:
    tau: float  # seconds per output token per engine
    seqs: float
    limited_by: str
    waits_kept: float


def _best_rate(work: _Work, p: EngineProfile, engines: int, inflight: float) -> _Best:
    """τ minimised over S and the tool waits kept (module docstring)."""
    o = work.outputs
    kv_seq = work.kv_weight / o  # k̄
    ctx = work.ctx_weight / o
    w = work.outside_s / o
    per_engine = inflight / engines
    # The waits cheapest to keep per second of re-prefill saved go first: along that order the
    # (KV·s kept, re-prefill left) pairs trace the lower frontier of every choice (fractional).
    order = np.argsort(work.keep_kv_s / np.maximum(work.reprefill_s, 1e-30), kind="stable")
    kept_kv = np.concatenate(([0.0], np.cumsum(work.keep_kv_s[order]))) / o
    left = (work.reprefill_s.sum() - np.concatenate(([0.0], np.cumsum(work.reprefill_s[order])))) / o
    left = np.maximum(left, 0.0)
    fixed = p.b * ctx + p.c * work.prefill_pairs / o
    u = work.prefill_tokens / o
    # Beyond the KV's or the in-flight bound's batch τ only grows (each idles the engine more
    # than a larger batch saves); S is fractional (time-shared between batch sizes).
    top = max(1.0, min(float(p.max_num_seqs), p.kv_tokens / max(kv_seq, 1.0), per_engine))
    grid = np.unique(np.concatenate((np.arange(1.0, 32.0, 0.1), np.arange(32.0, 128.0, 0.5),
                                     np.arange(128.0, top, 1.0), [top])))
    best: _Best | None = None
    for s in grid[grid <= top]:
        s = float(s)
        base = p.t0 / s + p.t_seq + max(p.linear_time(s) / s, p.a * (1 + u)) + fixed
        # τ along the frontier, at its corners and where two of the three times cross
        # inside a segment (each time is linear along a segment, τ their maximum).
        tau, at = _frontier_min(base, kept_kv, left, kv_seq * s, p.kv_tokens, s, w, per_engine)
        if best is None or tau < best.tau:
            best = _Best(tau, s, "", at)
    assert best is not None
    s = best.seqs
    base = p.t0 / s + p.t_seq + max(p.linear_time(s) / s, p.a * (1 + u)) + fixed
    tc = base + float(np.interp(best.waits_kept, np.arange(len(left)), left))
    kept = float(np.interp(best.waits_kept, np.arange(len(kept_kv)), kept_kv))
    times = {"kv": (kv_seq * s * tc + kept) / p.kv_tokens,
             "inflight_bound": (s * tc + w) / per_engine}
    binding = max(times, key=times.get)
    limited = ("max_num_seqs" if s >= p.max_num_seqs and times[binding] < tc * (1 + 1e-9)
               else binding)
    n = len(work.keep_kv_s)
    return _Best(best.tau, s, limited, best.waits_kept / n if n else 1.0)


def _frontier_min(base: float, kept_kv: np.ndarray, left: np.ndarray, kv_batch: float,
                  capacity: float, s: float, w: float, per_engine: float) -> tuple[float, float]:
    """min over the frontier of max(τ_c, (k̄·S·τ_c + kept)/C, (S·τ_c + w)/I_e), τ_c = base +
    left; returns (τ, position along the frontier: waits kept, fractional)."""
    tc = base + left
    lines = np.stack([tc, (kv_batch * tc + kept_kv) / capacity, (s * tc + w) / per_engine])
    corner = lines.max(axis=0)
    i = int(np.argmin(corner))
    best_t, best_at = float(corner[i]), float(i)
    if len(tc) > 1:
        d = lines[:, 1:] - lines[:, :-1]  # each time's change over a segment
        for a in range(3):
            for b in range(a + 1, 3):
                gap = lines[a, :-1] - lines[b, :-1]
                slope = d[b] - d[a]
                with np.errstate(divide="ignore", invalid="ignore"):
                    theta = np.where(slope != 0, gap / slope, -1.0)
                ok = np.nonzero((theta > 0) & (theta < 1))[0]
                if not len(ok):
                    continue
                vals = (lines[:, ok] + d[:, ok] * theta[ok]).max(axis=0)
                j = int(np.argmin(vals))
                if vals[j] < best_t:
                    best_t, best_at = float(vals[j]), float(ok[j] + theta[ok[j]])
    return best_t, best_at


def fluid_bound(scenario: Scenario, scenario_path: str | Path, samples: int = 2_000) -> FluidBound:
    fleet, trainer = scenario.fleet, scenario.trainer
    profile = (get_profile(fleet.profile).with_kv_tokens(fleet.kv_tokens)
               .with_limits(fleet.max_num_seqs, fleet.max_num_batched_tokens))
    sync = trainer.loop == "sync" and scenario.source == "generators"
    steps = sync_steps(scenario, scenario_path) if sync else []
    if sync:
        sessions = [s for step in steps for s in step]
    else:
        # An async run finishes its iterations' sessions while up to its in-flight bound are
        # still out when it ends: the slowest, at best. Short runs finish a biased share of
        # quick sessions, so the bound leaves that share of the slowest out of the sample.
        run = trainer.iterations * trainer.batch_size + trainer.inflight_bound
        sessions = sample_sessions(scenario, scenario_path, min(samples, run))
        unfinished = round(trainer.inflight_bound * len(sessions) / run)
        if unfinished:
            sessions = sorted(sessions, key=lambda x: _path_s(x, profile))[:-unfinished]
    if not sessions:
        raise ValueError("bound: the scenario yields no sessions")
    work = _work(sessions, profile)
    # A sync trainer keeps one step in flight (whole groups: at least its batch).
    inflight = (len(sessions) / len(steps)) if sync else float(trainer.inflight_bound)
    # A fleet that changes (fleet.changes) is bounded by the most engines it ever has at once.
    engines = fleet.most_engines
    best = _best_rate(work, profile, engines, inflight)
    rate = engines / best.tau
    barrier = 0.0
    if sync:
        fluid = slowest = 0.0
        for step in steps:
            fluid_s = sum(sum(s.truth.output_tokens) for s in step) / rate
            fluid += fluid_s
            slowest += max(fluid_s, max(_path_s(s, profile) for s in step))
        total = slowest + trainer.train_s * (len(steps) - 1)
        barrier = (total - fluid) / total if total > 0 else 0.0
        rate = work.outputs / total
    o = work.outputs
    return FluidBound(tokens_per_s=rate, seqs_per_engine=best.seqs,
                      limited_by=best.limited_by, mean_context=work.ctx_weight / o,
                      mean_kv_context=work.kv_weight / o,
                      prefill_per_output=work.prefill_tokens / o,
                      sessions_sampled=len(sessions), waits_kept=best.waits_kept,
                      outside_per_output=work.outside_s / o, barrier_share=barrier)
