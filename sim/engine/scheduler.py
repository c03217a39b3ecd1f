"""Continuous batching with chunked prefill and recompute preemption, after vLLM v1's
Scheduler.schedule() under the FCFS policy:

1. Running requests first, in order: each gets min(tokens it still needs, token budget). If its
   blocks don't fit, preempt the *last* running request (free its blocks, reset it to zero
   computed tokens, put it at the front of waiting) and retry; if it preempts itself, stop.
2. Only if nothing was preempted this step: waiting requests in FCFS order while the budget
   lasts and fewer than max_num_seqs run. A request's prefix-cache hit is looked up on its
   first scheduling (and again after a preemption); admission stops at the first request whose
   blocks don't fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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


class Scheduler:
    def __init__(self, profile: EngineProfile, kv: KVCacheManager) -> None:
        self.profile = profile
        self.kv = kv
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []

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
                victim = running.pop()
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
