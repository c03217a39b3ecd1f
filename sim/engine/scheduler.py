"""Continuous batching with chunked prefill and recompute preemption, after vLLM v1's
Scheduler.schedule(), under either of its policies (`--scheduling-policy`):

1. Running requests first, in order: each gets min(tokens it still needs, token budget). If its
   blocks don't fit, preempt a victim (free its blocks, reset it to zero computed tokens, put
   it back in waiting) and retry; if it preempts itself, stop. The victim under `fcfs` is the
   *last* running request, put back at the front of waiting; under `priority` it is the
   running request with the largest (priority, arrival time), put back in waiting by that key,
   and a victim already scheduled in this step gives its tokens back to the budget.
2. Only if nothing was preempted this step: waiting requests in order (arrival under `fcfs`,
   (priority, arrival time) under `priority`) while the budget lasts and fewer than
   max_num_seqs run. A request's prefix-cache hit is looked up on its first scheduling (and
   again after a preemption); admission stops at the first request whose blocks don't fit.

A step can then schedule nothing: under `priority` a request whose blocks do not fit may
preempt every request before it and then itself. vLLM returns that step empty; so does this.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from sim.engine.block_pool import Block
from sim.engine.kv_cache import KVCacheManager
from sim.engine.profiles import EngineProfile
from sim.engine.request import EngineRequest, RequestStatus


@dataclass(slots=True)
class ScheduledStep:
    scheduled: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[EngineRequest] = field(default_factory=list)
    duration: float = 0.0
    # Prefix-cache lookups recorded at admission: (tokens queried, tokens hit, was preempted).
    lookups: list[tuple[int, int, bool]] = field(default_factory=list)


SchedulingPolicy = Literal["fcfs", "priority"]


def check_scheduling_policy(policy: str) -> SchedulingPolicy:
    """`policy` if it is one of vLLM's `--scheduling-policy` values; else ValueError naming
    the field."""
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy: {policy!r} is not 'fcfs' or 'priority'")
    return policy  # type: ignore[return-value]


def _rank(req: EngineRequest) -> tuple[int, float, int]:
    """Where `priority` puts a request: (priority, arrival time), as vLLM's Request.__lt__ and
    its choice of victim. vLLM stamps arrivals with the wall clock, so two requests never tie
    on it and the later one added ranks last; here requests added at the same virtual time
    rank in the order they were added."""
    return req.priority, req.arrival_time, req.arrival_seq


class Scheduler:
    def __init__(self, profile: EngineProfile, kv: KVCacheManager,
                 policy: SchedulingPolicy = "fcfs") -> None:
        check_scheduling_policy(policy)
        self.profile = profile
        self.kv = kv
        self.by_priority = policy == "priority"
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []

    def add_waiting(self, req: EngineRequest) -> None:
        """An arrival joins waiting: at the back under `fcfs`, in `_rank` order under
        `priority`."""
        if not self.by_priority:
            self.waiting.append(req)
            return
        self._insert(req)

    def _insert(self, req: EngineRequest) -> None:
        waiting = self.waiting
        key = _rank(req)
        i = len(waiting)
        while i > 0 and _rank(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, req)

    def _victim(self) -> int:
        """The index in `running` of the request a failed allocation preempts: the last one, or
        under `priority` the one ranked last (`_rank`)."""
        running = self.running
        if not self.by_priority:
            return len(running) - 1
        worst = 0
        for j in range(1, len(running)):
            if _rank(running[j]) > _rank(running[worst]):
                worst = j
        return worst

    def step_duration(self, scheduled: list[tuple[EngineRequest, int]]) -> float:
        p = self.profile
        n_tokens = 0
        decode_ctx = 0
        prefill_pairs = 0.0
        for req, n in scheduled:
            n_tokens += n
            ctx = req.num_computed_tokens  # before this step
            if n == 1 and ctx == req.num_tokens - 1 and req.num_output_tokens > 0:
                decode_ctx += ctx
            else:
                prefill_pairs += n * (ctx + n / 2)
        return (p.t0 + p.t_seq * len(scheduled) + p.linear_time(n_tokens) + p.b * decode_ctx
                + p.c * prefill_pairs)

    def preempt(self, victim: EngineRequest) -> None:
        """Recompute preemption: drop the victim's KV (cached blocks keep their hashes) and
        put it at the front of waiting. The caller has removed it from `running`."""
        self.kv.free(victim)
        victim.status = RequestStatus.preempted
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        if self.by_priority:
            self._insert(victim)
        else:
            self.waiting.appendleft(victim)

    def schedule(self) -> ScheduledStep:
        p = self.profile
        kv = self.kv
        step = ScheduledStep()
        budget = p.max_num_batched_tokens
        running = self.running
        i = 0
        bs = kv.block_size
        pool = kv.pool
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n == 1 and req.num_output_tokens > 0 and (
                    len(req.blocks) * bs >= req.num_tokens or pool.num_free > 0):
                # Decode fast path (same effect as allocate_slots for one new token; prompt
                # blocks of a decoding request are all cached already). A prefill whose last
                # chunk is one token is not a decode: allocate_slots must cache its last
                # prompt block now, as vLLM does, so requests admitted later in this step hit it.
                if len(req.blocks) * bs < req.num_tokens:
                    req.blocks.extend(pool.get_new_blocks(1))
                step.scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            n = min(n, budget, kv.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not kv.allocate_slots(req, n):
                v = self._victim()
                victim = running.pop(v)
                if v < i:  # scheduled earlier in this step: its tokens go back to the budget
                    for k, (done, tokens) in enumerate(step.scheduled):
                        if done is victim:
                            del step.scheduled[k]
                            budget += tokens
                            break
                    i -= 1
                self.preempt(victim)
                step.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            step.scheduled.append((req, n))
            budget -= n
            i += 1

        if not step.preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < p.max_num_seqs:
                req = waiting[0]
                hits: list[Block] = kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
                n_hit = len(hits) * kv.block_size
                n = min(req.num_tokens - n_hit, budget)
                if not kv.allocate_slots(req, n, hits):
                    break
                waiting.popleft()
                step.lookups.append((req.num_tokens, n_hit, req.num_preemptions > 0))
                req.num_computed_tokens = n_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = n_hit
                req.status = RequestStatus.running
                running.append(req)
                step.scheduled.append((req, n))
                budget -= n
        step.duration = self.step_duration(step.scheduled) if step.scheduled else 0.0
        return step
