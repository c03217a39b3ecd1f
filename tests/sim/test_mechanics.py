"""The simulator on sim/mechanics.py's trace 0 gives the figures real vLLM 0.32.0 gave on it
(recorded 2026-12-06 with benchmarks/engine_mechanics.py; tests/vllm/test_mechanics.py runs
vLLM itself where it is installed). A change to the scheduler or the KV cache that moves any
of them moves the simulator away from vLLM."""

from __future__ import annotations

from sim.mechanics import default_trace, run_sim

# phase: (queries, hits, recompute queries, recompute hits, preemptions), as vLLM counted them
VLLM_0_32_0 = {
    "shared prefixes": (1584, 768, 0, 0, 0),
    "multi-turn": (1932, 1696, 0, 0, 0),
    "thrash": (1536, 704, 2246, 672, 6),
    "thrash, next turns": (3294, 416, 1246, 352, 2),
}
CACHED_AT_FIRST_SCHEDULING = {  # per request, as vLLM reported num_cached_tokens
    "s0": 0, "s1": 256, "s2": 256, "s3": 256, "u0": 0, "u1": 0,
    "s0.2": 288, "s1.2": 320, "s2.2": 320, "s3.2": 320, "u0.2": 224, "u1.2": 224,
}


def test_trace_0_gives_vllms_own_figures():
    phases = run_sim(default_trace(0))
    got = {p.name: (p.queries, p.hits, p.preempted_queries, p.preempted_hits, p.preemptions)
           for p in phases}
    assert got == VLLM_0_32_0
    cached = {rid: r.cached_tokens for p in phases[:2] for rid, r in p.requests.items()}
    assert cached == CACHED_AT_FIRST_SCHEDULING
    thrash = phases[2].requests
    assert [thrash[f"t{i}"].finish_rank for i in range(12)] == list(range(12))
    assert all(r.finish_reason == "length" for p in phases for r in p.requests.values())
