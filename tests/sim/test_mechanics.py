"""The simulator on sim/mechanics.py's trace 0 gives the figures real vLLM 0.32.0 gave on it
(recorded 2026-12-06 with benchmarks/engine_mechanics.py; tests/vllm/test_mechanics.py runs
vLLM itself where it is installed). A change to the scheduler or the KV cache that moves any
of them moves the simulator away from vLLM."""

from __future__ import annotations

from sim.mechanics import EngineShape, default_trace, run_sim

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


# The same trace with priorities on its long requests (`default_trace(s, priorities=True)`),
# both engines under --scheduling-policy priority: vLLM 0.32.0's figures (recorded 2026-12-08
# with `benchmarks/engine_mechanics.py --seeds 0,1,2,3 --scheduling-policy priority`, where
# every counter, every request and the order of every pair agreed on all four seeds).
VLLM_0_32_0_PRIORITY = {
    0: {"shared prefixes": (1584, 768, 0, 0, 0), "multi-turn": (1932, 1696, 0, 0, 0),
        "thrash": (1536, 704, 2246, 672, 6), "thrash, next turns": (3294, 384, 1206, 320, 2)},
    3: {"shared prefixes": (1574, 480, 0, 0, 0), "multi-turn": (2093, 1728, 0, 0, 0),
        "thrash": (3530, 1920, 4741, 2528, 13), "thrash, next turns": (5101, 1024, 577, 192, 1)},
}
# Trace 0's long requests in the order vLLM finished them under priority (their priorities:
# t0, t1, t4, t6, t8, t10 are 0; t5, t7, t9, t11 are 1; t2, t3 are 2). Under fcfs they finish
# t0 ... t11 in turn.
PRIORITY_THRASH_RANKS = {"t0": 0, "t1": 1, "t4": 2, "t6": 3, "t8": 4, "t10": 5, "t5": 6,
                         "t7": 7, "t9": 8, "t2": 9, "t11": 10, "t3": 11}


def test_trace_under_priority_scheduling_gives_vllms_own_figures():
    shape = EngineShape(scheduling_policy="priority")
    for seed, phases_vllm in VLLM_0_32_0_PRIORITY.items():
        phases = run_sim(default_trace(seed, priorities=True), shape)
        got = {p.name: (p.queries, p.hits, p.preempted_queries, p.preempted_hits, p.preemptions)
               for p in phases}
        assert got == phases_vllm, f"seed {seed}"
        if seed == 0:
            thrash = phases[2].requests
            assert {rid: r.finish_rank for rid, r in thrash.items()} == PRIORITY_THRASH_RANKS
