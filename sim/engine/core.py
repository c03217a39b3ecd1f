"""EngineCore: the simulated vLLM engine on a virtual clock, advanced in bulk between events.

The clock moves in *segments*. A segment is either one scheduler step (planned by running
`schedule()`, which allocates at once, as vLLM does; its tokens land when it ends) or a run of
k pure-decode steps (every running request is decoding, nothing in waiting can be admitted,
no block shortage): those are computed in closed form — tokens, block needs and time — and
applied in one go. A decode run ends at the first of: a request finishing, the step before the
free queue runs short (the next step preempts), or the next arrival. A request added in the
middle of a planned run cuts it at the first step boundary after its arrival, so bulk
advancing gives exactly the step sequence of stepping one by one.

Drivers: the fleet simulator calls `next_event_time()` / `advance(until)` / `add_request`;
the HTTP server's wall-clock driver calls `advance(until=virtual_now)` on a timer. A driver that
keeps many engines indexed by their next event time sets `on_change`: every public method that
may change `next_event_time()` calls it when it returns.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.engine.kv_cache import KVCacheManager
from sim.engine.profiles import EngineProfile
from sim.engine.request import EngineRequest, FinishReason, RequestStatus
from sim.engine.sampling import eos_length, request_seed
from sim.engine.scheduler import ScheduledStep, Scheduler, SchedulingPolicy


@dataclass(frozen=True, slots=True)
class EngineStats:
    now: float
    kv_usage: float  # vllm:kv_cache_usage_perc
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    prefix_queries_total: int  # tokens looked up by requests never preempted
    prefix_hits_total: int
    preempted_prefix_queries_total: int  # the same for recomputes after preemption
    preempted_prefix_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_gpu_blocks: int
    block_size: int
    requests_finished_total: dict[FinishReason, int]
    steps_total: int
    busy_time: float  # virtual seconds spent in steps


@dataclass(slots=True)
class _DecodeRun:
    start: float
    k: int  # steps in the run
    reqs: list[EngineRequest]
    base: float  # per-step time without the growing-context term
    growth: float  # b × batch size: each step's context term grows by this
    end: float
    tokens: np.ndarray | None = None  # num_tokens of each request at the run's start
    blocks: np.ndarray | None = None  # blocks each request holds at the run's start
    left: np.ndarray | None = None  # output tokens each request has left at the run's start
    preempted: int = 0  # requests preempted when this (single-step) run was planned: atomic

    def elapsed(self, j: int) -> float:
        """Duration of the first j steps of the run."""
        return j * self.base + self.growth * j * (j - 1) / 2.0


@dataclass(slots=True)
class _Step:
    start: float
    step: ScheduledStep
    end: float


class EngineCore:
    def __init__(self, profile: EngineProfile, *, kv_tokens: int | None = None, seed: int = 0,
                 bulk: bool = True, scheduling_policy: SchedulingPolicy = "fcfs") -> None:
        """`bulk=False` plans every step through `Scheduler.schedule()`, one at a time: the
        reference the bulk path is tested against (same steps, same times, same tokens).
        `scheduling_policy`: vLLM's `--scheduling-policy` (`Scheduler`)."""
        self.profile = profile.with_kv_tokens(kv_tokens)
        p = self.profile
        self.block_size = p.block_size
        self.num_gpu_blocks = p.num_gpu_blocks
        # vLLM refuses to start when max_model_len does not fit the KV cache; we shrink it.
        self.max_model_len = min(p.max_model_len, (self.num_gpu_blocks - 1) * p.block_size)
        self.seed = seed
        self.bulk = bulk
        self.kv = KVCacheManager(self.num_gpu_blocks, p.block_size, self.max_model_len)
        self.scheduler = Scheduler(p, self.kv, scheduling_policy)
        self.now = 0.0
        self._clock = 0.0  # the latest `until` the driver has advanced to
        self.requests: dict[str, EngineRequest] = {}  # unfinished, by id
        self._arrivals: list[tuple[float, int, EngineRequest]] = []
        self._seq = itertools.count()
        self._plan: _Step | _DecodeRun | None = None
        self._done: list[EngineRequest] = []
        self._pending_aborts: set[str] = set()
        self._frozen = False  # paused with mode=keep: no step starts until `unfreeze`
        # Called (no arguments) whenever next_event_time() may have changed: at the end of
        # add_request, abort_request, settle, freeze, unfreeze and advance — the only methods
        # that change what it reads (_plan, _frozen, the scheduler's queues, _arrivals, now).
        self.on_change: Callable[[], None] | None = None
        # (running list, num_tokens, blocks, tokens left) as the last decode run left them;
        # valid only while `scheduler.running` is that same list of requests.
        self._decode_batch: tuple[list[EngineRequest], np.ndarray, np.ndarray, np.ndarray] | None = None
        # Counters (vLLM's metric meanings; see EngineStats).
        self._preemptions = 0
        self._queries = self._hits = self._p_queries = self._p_hits = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_by_reason = {r: 0 for r in FinishReason}
        self._steps = 0
        self._busy = 0.0

    # -- requests ------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise ValueError("<field>: reason") for a request vLLM would reject."""
        if not req.prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {req.max_tokens}")
        vocab = self.profile.vocab_size
        # Tokens under caller-supplied prefix hashes were checked when they were first sent.
        fresh = req.prompt_token_ids[len(req.block_hashes) * self.block_size:] or req.prompt_token_ids
        lo, hi = min(fresh), max(fresh)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt: token id {bad} is out of vocabulary (size {vocab})")
        n = len(req.prompt_token_ids)
        if n + req.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {n + req.max_tokens} tokens ({n} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        if req.output_len is not None and req.output_len < 1:
            raise ValueError(f"sim_output_len: must be at least 1, got {req.output_len}")
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already running")

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        p = self.profile
        req.token_seed = request_seed(self.seed, req.request_id, req.seed) ^ req.lora_seed
        req.vocab_size = p.vocab_size
        req.num_prompt_tokens = len(req.prompt_token_ids)
        req.num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if req.ignore_eos:
            stop = req.max_tokens
        elif req.output_len is not None:
            stop = req.output_len
        else:
            stop = eos_length(req.token_seed, p.eos_median, p.eos_sigma)
        if req.output_len is None:
            stop = max(stop, req.min_tokens)  # vLLM holds back EOS until min_tokens
        if req.forced_ending is not None:  # the ending fits whole, unless max_tokens cuts it
            req.ending_ids = list(req.forced_ending(req.token_seed))
            stop = max(stop, len(req.ending_ids))
            req.ending_start = stop - len(req.ending_ids)
        req.stop_len = min(stop, req.max_tokens, self.max_model_len - req.num_prompt_tokens)
        if req.stop_token_ids or req.stop_scan is not None:
            self._apply_stop_conditions(req)
        t = max(req.arrival_time, self.now)
        if not self.scheduler.by_priority:
            req.arrival_time = t
        # (Under `priority` the arrival time ranks requests, so it stays the caller's: a bulk
        # engine's clock can be a step ahead of the driver's, a stepped one's is not.)
        self._cut_decode_run(t)
        self.requests[req.request_id] = req
        req.arrival_seq = next(self._seq)
        heapq.heappush(self._arrivals, (t, req.arrival_seq, req))
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @staticmethod
    def _apply_stop_conditions(req: EngineRequest) -> None:
        """End the request at its first stop token id or stop string, if one comes before
        `stop_len`: output ids are a pure function of the seed, so where they stop is known
        when the request arrives and the engine never computes tokens past it."""
        ids = req.output_token_ids_upto(req.stop_len)
        hit: tuple[int, int | str] | None = None
        if req.stop_token_ids:
            for i in range(req.min_tokens, len(ids)):  # masked before min_tokens
                if ids[i] in req.stop_token_ids:
                    hit = (i + 1, ids[i])
                    break
        if req.stop_scan is not None:
            found = req.stop_scan(ids[: hit[0]] if hit else ids, req.min_tokens)
            if found is not None and (hit is None or found[0] < hit[0]):
                hit = found
        if hit is not None:
            req.stop_len, req.stop_reason = hit

    def abort_request(self, request_id: str) -> EngineRequest | None:
        """Abort at the next step boundary (a step in flight completes first, as in vLLM)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._cut_decode_run(self.now)
        self._pending_aborts.add(request_id)
        if self._plan is None:
            self._apply_aborts()
        self._changed()
        return req

    def settle(self, t: float) -> None:
        """Apply every step that starts before `t` (a step in flight then completes): what a
        real engine has generated by `t`, before the engine stops stepping (pause)."""
        self._cut_decode_run(t)
        self._changed()

    def freeze(self, t: float) -> None:
        """Stop stepping at `t` (vLLM's pause with mode=keep): the step in flight completes,
        then every request keeps its KV and its place until `unfreeze`; arrivals queue."""
        self.settle(t)
        self._frozen = True
        self._changed()

    def unfreeze(self, t: float) -> None:
        """Start stepping again at `t` (vLLM's resume after a keep pause)."""
        self._frozen = False
        if self._plan is None:  # (a step in flight at the freeze may not have ended yet)
            self._idle_to(t)
        self._changed()

    def abort_all(self) -> list[str]:
        """Abort every unfinished request at the next step boundary; returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's /reset_prefix_cache): False while requests hold KV."""
        return self.kv.pool.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._done)

    # -- the clock -----------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        """When the engine next needs the driver: the end of the planned segment; `now` when it
        has work but no plan yet (plans are made inside `advance`, once the driver's clock has
        reached `now`, so that no arrival up to then can be missed); the next arrival when idle."""
        if self._plan is not None:
            return self._plan.end
        if self._frozen:
            return None
        sch = self.scheduler
        if sch.running or sch.waiting or (self._arrivals and self._arrivals[0][0] <= self.now):
            return self.now
        return self._arrivals[0][0] if self._arrivals else None

    def advance(self, until: float) -> list[EngineRequest]:
        """Complete every segment that ends by `until`; return requests finished so far.
        A planned decode run that ends later stays planned (an arrival may still cut it)."""
        if until > self._clock:
            self._clock = until
        while True:
            self._admit_arrivals()
            if self._plan is None and self.now > until:
                break  # the driver may still deliver arrivals up to our clock: don't plan yet
            if self._plan is None and self._frozen:
                self._idle_to(max(self.now, until))
                break
            if self._plan is None and not self._make_plan():
                nxt = self._arrivals[0][0] if self._arrivals else None
                if nxt is not None and nxt <= until:
                    self._idle_to(nxt)
                    continue
                self._idle_to(max(self.now, until))
                break
            if self._plan.end > until:
                break
            self._complete()
        done, self._done = self._done, []
        self._changed()
        return done

    def run_until_idle(self, limit: float = float("inf")) -> list[EngineRequest]:
        """Advance until nothing is left (or `limit`); for tests and benchmarks."""
        done: list[EngineRequest] = []
        while self.has_unfinished():
            t = self.next_event_time()
            if t is None or t > limit:
                break
            done += self.advance(t)
        return done

    def _idle_to(self, t: float) -> None:
        if t > self.now:
            self.now = t

    def _admit_arrivals(self) -> None:
        arr = self._arrivals
        while arr and arr[0][0] <= self.now:
            self.scheduler.add_waiting(heapq.heappop(arr)[2])
        if self._pending_aborts and self._plan is None:
            self._apply_aborts()

    # -- planning ------------------------------------------------------------------------
    def _make_plan(self) -> bool:
        sch = self.scheduler
        if not sch.running and not sch.waiting:
            return False
        run = self._plan_decode_run() if self.bulk else None
        if run is not None:
            self._plan = run
            return True
        step = sch.schedule()
        if not step.scheduled and not step.preempted:
            raise RuntimeError(f"scheduler made no progress: {sch.running[:3]} {list(sch.waiting)[:3]}")
        self._plan = _Step(self.now, step, self.now + step.duration)
        return True

    def _plan_decode_run(self) -> _DecodeRun | None:
        sch = self.scheduler
        running = sch.running
        if not running:
            return None
        batch = self._decode_batch
        if batch is not None and batch[0] == running:
            _, L, nb, left = batch  # the batch a decode run left behind, still decoding
        else:
            tokens, blocks, remaining = [], [], []
            for r in running:
                t = r.num_tokens
                if r.num_output_tokens == 0 or r.num_computed_tokens != t - 1:
                    return None
                tokens.append(t)
                blocks.append(len(r.blocks))
                remaining.append(r.stop_len - r.num_output_tokens)
            L = np.array(tokens, dtype=np.int64)
            nb = np.array(blocks, dtype=np.int64)
            left = np.array(remaining, dtype=np.int64)
        kv = self.kv
        bs = self.block_size
        free = kv.pool.num_free
        n = len(running)
        budget = self.profile.max_num_batched_tokens - n  # what a decode step leaves for waiting
        if budget < 0:
            return None  # not every running request fits a step: let schedule() pick
        if sch.waiting and budget > 0 and n < self.profile.max_num_seqs:
            head = sch.waiting[0]
            hits = kv.get_computed_blocks(head) if head.num_computed_tokens == 0 else []
            # schedule() admits a chunk of at most `budget` tokens, not the whole prompt.
            if kv.can_allocate(head, min(head.num_tokens - len(hits) * bs, budget), hits):
                return None  # the next step admits it: plan that step on its own
        k = int(left.min())

        def need(j: int) -> int:  # new blocks for steps 0..j
            return int(np.maximum(0, (L + j + bs - 1) // bs - nb).sum())

        if need(0) > free:
            if sch.by_priority:
                return None  # its victims are not the batch's tail: schedule() picks them
            return self._plan_preempting_decode_step(L, nb, left)
        if need(k - 1) > free:
            lo, hi = 0, k - 1  # need(lo) fits, need(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if need(mid) <= free:
                    lo = mid
                else:
                    hi = mid
            k = lo + 1
        p = self.profile
        ctx = int(L.sum()) - n  # decode context = computed tokens = num_tokens − 1 each
        base = p.t0 + p.t_seq * n + p.linear_time(n) + p.b * ctx
        run = _DecodeRun(self.now, k, list(running), base, p.b * n, 0.0, tokens=L, blocks=nb, left=left)
        if self._arrivals:
            k = min(k, self._steps_before(run, self._arrivals[0][0]))
            run.k = k
        run.end = self.now + run.elapsed(k)
        return run

    def _plan_preempting_decode_step(self, L: np.ndarray, nb: np.ndarray, left: np.ndarray) -> _DecodeRun:
        """One all-decode step that is short of blocks, in closed form: exactly what
        `Scheduler.schedule()` does — pop the last running request until the needs of those
        left fit — without walking the batch in Python."""
        sch = self.scheduler
        running = sch.running
        bs = self.block_size
        cum = np.cumsum(np.maximum(0, (L + bs - 1) // bs - nb))
        victims = []
        m = len(running)
        while m > 0 and int(cum[m - 1]) > self.kv.pool.num_free:
            victim = running.pop()
            sch.preempt(victim)
            victims.append(victim)
            m -= 1
        p = self.profile
        ctx = int(L[:m].sum()) - m
        run = _DecodeRun(self.now, 1, list(running), p.t0 + p.t_seq * m + p.linear_time(m) + p.b * ctx,
                         p.b * m, 0.0, tokens=L[:m], blocks=nb[:m], left=left[:m],
                         preempted=len(victims))
        run.end = self.now + run.elapsed(1) if m else self.now
        return run

    @staticmethod
    def _steps_before(run: _DecodeRun, t: float, inclusive: bool = False) -> int:
        """How many of the run's steps start before time t (at or before it if `inclusive`);
        at least 1: the run starts now."""
        span = t - run.start

        def starts_in(j: int) -> bool:  # does step j (0-based) start before t?
            e = run.elapsed(j)
            return e <= span if inclusive else e < span

        lo, hi = 1, run.k  # step 0 counts (it starts now)
        if starts_in(hi - 1):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if starts_in(mid - 1):
                lo = mid
            else:
                hi = mid
        return lo

    def _cut_decode_run(self, t: float) -> None:
        """An arrival or abort at time t: apply the planned run's steps that start before t,
        and every step that starts by the driver's clock — those are already in flight (the
        step-by-step path has planned them), so the event lands after them."""
        run = self._plan
        if not isinstance(run, _DecodeRun):
            return
        if t <= run.start and self._clock < run.start:
            if not run.preempted:
                self._plan = None  # nothing happened yet: re-plan with the newcomer
            return
        k = self._steps_before(run, t)
        if self._clock >= run.start:
            k = max(k, self._steps_before(run, self._clock, inclusive=True))
        if k < run.k:
            run.k = k
            run.end = run.start + run.elapsed(k)
        self._complete()

    # -- applying segments ---------------------------------------------------------------
    def _complete(self) -> None:
        plan = self._plan
        if isinstance(plan, _DecodeRun):
            finished = self._apply_decode_run(plan)
        else:
            finished = self._apply_step(plan)
        dt = plan.end - self.now
        self._busy += dt
        self.now = plan.end
        self._plan = None
        for req in finished:
            self._finish(req)
        self._apply_aborts()

    def _apply_decode_run(self, run: _DecodeRun) -> list[EngineRequest]:
        k = run.k
        bs = self.block_size
        reqs = run.reqs
        get_new_blocks = self.kv.pool.get_new_blocks
        # Slots for num_tokens + k − 1 tokens: the last step feeds the token before the newest.
        n_new = (run.tokens + (k - 2)) // bs + 1 - run.blocks
        needy = np.flatnonzero(n_new > 0)
        if len(needy):
            counts = n_new[needy].tolist()
            fresh = get_new_blocks(sum(counts))
            pos = 0
            for i, c in zip(needy.tolist(), counts):
                reqs[i].blocks.extend(fresh[pos:pos + c])
                pos += c
        for r in reqs:
            r.num_computed_tokens += k
            r.num_output_tokens += k
            r.num_tokens += k
        left = run.left - k
        done = np.flatnonzero(left <= 0).tolist()
        finished = [reqs[i] for i in done]
        # What the next plan would rebuild from the requests, carried over in array form.
        keep = left > 0
        survivors = [r for r in reqs if r.num_output_tokens < r.stop_len] if done else reqs
        self._decode_batch = (survivors, (run.tokens + k)[keep],
                              (run.blocks + np.maximum(n_new, 0))[keep], left[keep])
        self._generation_tokens += k * len(run.reqs)
        self._preemptions += run.preempted
        self._steps += k
        return finished

    def _apply_step(self, plan: _Step) -> list[EngineRequest]:
        self._decode_batch = None
        step = plan.step
        for queried, hit, preempted in step.lookups:
            if preempted:
                self._p_queries += queried
                self._p_hits += hit
            else:
                self._queries += queried
                self._hits += hit
        self._preemptions += len(step.preempted)
        finished = []
        for req, n in step.scheduled:
            if req.status is not RequestStatus.running:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                if req.num_output_tokens == 0:
                    req.first_token_time = plan.end
                    self._prompt_tokens += req.num_prompt_tokens
                req.num_output_tokens += 1
                req.num_tokens += 1
                self._generation_tokens += 1
                if req.num_output_tokens >= req.stop_len:
                    finished.append(req)
        self._steps += 1
        return finished

    def _finish(self, req: EngineRequest, reason: FinishReason | None = None) -> None:
        sch = self.scheduler
        if req.status is RequestStatus.running:
            sch.running.remove(req)
        elif req in sch.waiting:
            sch.waiting.remove(req)
        self.kv.free(req)
        if reason is None and (req.stop_reason is not None or req.ends_with_eos):
            reason = FinishReason.stop
        elif reason is None:
            capped = req.stop_len == req.max_tokens or req.num_tokens >= self.max_model_len
            reason = FinishReason.length if capped or req.ignore_eos else FinishReason.stop
        req.status = RequestStatus.finished
        req.finish_reason = reason
        req.finish_time = self.now
        self._finished_by_reason[reason] += 1
        self.requests.pop(req.request_id, None)
        self._done.append(req)

    def _apply_aborts(self) -> None:
        if not self._pending_aborts:
            return
        self._decode_batch = None
        for rid in sorted(self._pending_aborts):
            req = self.requests.get(rid)
            if req is not None:
                self._arrivals = [a for a in self._arrivals if a[2] is not req]
                heapq.heapify(self._arrivals)
                self._finish(req, FinishReason.abort)
        self._pending_aborts.clear()

    # -- observation ---------------------------------------------------------------------
    def stats(self, at: float | None = None) -> EngineStats:
        """The engine's counters as of `at` (default: the driver's clock), as vLLM's /metrics
        would report them then: a planned decode run's steps that have completed by `at` are
        counted (their tokens and the blocks they took), although the run is applied to the
        requests only when it ends or is cut."""
        kv_usage = self.kv.pool.usage()
        generated, steps, busy = self._generation_tokens, self._steps, self._busy
        run = self._plan
        if isinstance(run, _DecodeRun):
            j = self.decoded_by(at)
            # vLLM's scheduler gives a step its slots before it runs: the step in flight holds
            # its new blocks already.
            slots = min(j + 1, run.k)
            taken = int(np.maximum(0, (run.tokens + (slots - 2)) // self.block_size + 1
                                   - run.blocks).sum())
            kv_usage = 1.0 - (self.kv.pool.num_free - taken) / (self.num_gpu_blocks - 1)
            generated += j * len(run.reqs)
            steps += j
            busy += run.elapsed(j)
        return EngineStats(
            now=self.now,
            kv_usage=kv_usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._arrivals),
            num_preemptions_total=self._preemptions,
            prefix_queries_total=self._queries,
            prefix_hits_total=self._hits,
            preempted_prefix_queries_total=self._p_queries,
            preempted_prefix_hits_total=self._p_hits,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=generated,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            requests_finished_total=dict(self._finished_by_reason),
            steps_total=steps,
            busy_time=busy,
        )

    def computed_tokens(self, at: float | None = None) -> dict[str, int]:
        """The tokens each unfinished request has KV for as of `at` (default: the driver's
        clock), the steps the decode run in flight has done by then included."""
        held = {rid: r.num_computed_tokens for rid, r in list(self.requests.items())}
        run = self._plan
        j = self.decoded_by(at)
        if j:
            for r in run.reqs:
                if r.request_id in held:
                    held[r.request_id] += j
        return held

    def decoded_by(self, at: float | None = None) -> int:
        """How many steps of the planned decode run have completed by `at` (default: the
        driver's clock); every request in the run has that many more tokens, and the KV for
        them, than its fields say until the run is applied. 0 outside a decode run."""
        run = self._plan
        at = self._clock if at is None else at
        if not isinstance(run, _DecodeRun) or at <= run.start:
            return 0
        started = self._steps_before(run, at, inclusive=True)
        # Every step that started by `at` has ended by then but the last, which has only if it
        # is the run's last and ends by `at` (else the next one would have started).
        ended = started == run.k and run.elapsed(started) <= at - run.start
        return started if ended else started - 1

    def check_invariants(self) -> None:
        """Assert the cache and scheduler invariants (tests call this after every step)."""
        self.kv.pool.check_invariants()
        sch = self.scheduler
        held = {b.block_id for r in sch.running for b in r.blocks}  # shared blocks count once
        assert len(held) + self.kv.pool.num_free <= self.num_gpu_blocks - 1
        assert len(sch.running) <= self.profile.max_num_seqs
        for r in sch.running:
            assert r.status is RequestStatus.running
            assert r.num_computed_tokens <= r.num_tokens
            assert len(r.blocks) * self.block_size >= r.num_computed_tokens
            assert r.num_output_tokens <= r.stop_len
        for r in sch.waiting:
            assert not r.blocks and r.num_computed_tokens == 0
