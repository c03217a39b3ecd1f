"""Each engine profile against the published measurements it was derived from.

Simulated values come from driving EngineCore with real requests (one request, a batch that
shares one cached prompt, or a closed loop as `vllm bench serve --max-concurrency` runs it),
never from the step-time formula. Source keys are those of sim/engine/profiles.py's docstring;
docs/engine-model.md has the table with the errors. `measured`: the source measured this
quantity on this GPU and model; `derived`: extrapolated (how, and its error bar, in the docs),
pinned so that a change of the cost model shows up here.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from sim.engine.core import EngineCore
from sim.engine.profiles import PROFILES, EngineProfile, get_profile
from sim.engine.request import EngineRequest

MS = 1e-3


# -- drivers ---------------------------------------------------------------------------------

def _prompt(n: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(1_000, 120_000, size=n).tolist()  # below both vocabularies


def single_ttft(profile: EngineProfile, prompt_len: int) -> float:
    """Time to first token of one request on an idle engine (no cached prefix)."""
    core = EngineCore(profile)
    req = EngineRequest("r", _prompt(prompt_len, np.random.default_rng(prompt_len)), 2, output_len=2)
    core.add_request(req)
    core.run_until_idle()
    return req.first_token_time - req.arrival_time


def decode_tpot(profile: EngineProfile, streams: int, context: int, outputs: int = 129) -> float:
    """Mean time per output token of `streams` requests decoding together from `context`
    tokens of KV. The prompt is computed once by a warm-up request, so the batch starts from
    cached KV (as vLLM's DecodeBenchConnector fills it): a pure decode measurement."""
    prompt = _prompt(context, np.random.default_rng(context))
    core = EngineCore(profile)
    core.add_request(EngineRequest("warm", prompt, 1, output_len=1))
    core.run_until_idle()
    reqs = [EngineRequest(f"r{i}", prompt, outputs, output_len=outputs, arrival_time=core.now)
            for i in range(streams)]
    for r in reqs:
        core.add_request(r)
    core.run_until_idle()
    return statistics.fmean((r.finish_time - r.first_token_time) / (outputs - 1) for r in reqs)


@dataclass(frozen=True, slots=True)
class LoopResult:
    ttft_median: float
    ttft_mean: float
    tpot_mean: float
    itl_median: float  # token-weighted median of decode step durations
    duration: float
    output_rate: float  # generated tokens per second over the whole run


def closed_loop(profile: EngineProfile, lengths: tuple[tuple[int, int], ...], concurrency: int,
                seed: int = 0) -> LoopResult:
    """`vllm bench serve --max-concurrency`: `concurrency` requests start at once and each
    finished one is replaced by the next. Stepped one scheduler step at a time, so each step's
    duration is an inter-token latency of the tokens it decodes."""
    rng = np.random.default_rng(seed)
    core = EngineCore(profile, bulk=False)
    todo = [EngineRequest(f"r{i}", _prompt(n_in, rng), n_out, output_len=n_out)
            for i, (n_in, n_out) in enumerate(lengths)]
    sent = todo[:concurrency]
    for r in sent:
        core.add_request(r)
    no_first = list(sent)
    itl: list[tuple[float, int]] = []
    while core.has_unfinished():
        t_before, gen_before = core.now, core.stats().generation_tokens_total
        done = core.advance(core.next_event_time())
        firsts = sum(1 for r in no_first if r.first_token_time is not None)
        no_first = [r for r in no_first if r.first_token_time is None]
        decoded = core.stats().generation_tokens_total - gen_before - firsts
        if decoded > 0:
            itl.append((core.now - t_before, decoded))
        for r in done:
            if len(sent) < len(todo):
                nxt = todo[len(sent)]
                nxt.arrival_time = r.finish_time
                core.add_request(nxt)
                sent.append(nxt)
                no_first.append(nxt)
    itl.sort()
    half, acc, itl_median = sum(n for _, n in itl) / 2, 0, 0.0
    for d, n in itl:
        acc += n
        if acc >= half:
            itl_median = d
            break
    duration = max(r.finish_time for r in todo)
    return LoopResult(
        ttft_median=statistics.median(r.first_token_time - r.arrival_time for r in todo),
        ttft_mean=statistics.fmean(r.first_token_time - r.arrival_time for r in todo),
        tpot_mean=statistics.fmean((r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
                                   for r in todo),
        itl_median=itl_median, duration=duration,
        output_rate=sum(r.num_output_tokens for r in todo) / duration)


def offline_output_rate(profile: EngineProfile, requests: int, prompt_len: int, outputs: int) -> float:
    """All requests at t=0 (an offline run): generated tokens per second until the last ends."""
    rng = np.random.default_rng(1)
    core = EngineCore(profile)
    reqs = [EngineRequest(f"r{i}", _prompt(prompt_len, rng), outputs, output_len=outputs)
            for i in range(requests)]
    for r in reqs:
        core.add_request(r)
    core.run_until_idle()
    return sum(r.num_output_tokens for r in reqs) / max(r.finish_time for r in reqs)


def _spread(n: int, mean: int, frac: float, rng: np.random.Generator) -> list[int]:
    """`vllm bench serve --random-range-ratio frac`: uniform in [mean·(1−frac), mean·(1+frac)]."""
    return rng.integers(int(mean * (1 - frac)), int(mean * (1 + frac)) + 1, size=n).tolist()


_rng = np.random.default_rng(7)
# [FP8KV] Table 4's workload: 150 requests, ~20k in / ~2k out (±15%), concurrency 8.
FP8KV_LOAD = tuple(zip(_spread(150, 20_000, 0.15, _rng), _spread(150, 2_000, 0.15, _rng)))
# [IX]'s workload: 20 random 32,768-token prompts, 100 outputs each, concurrency 10.
IX_LOAD = ((32_768, 100),) * 20


@cache
def fp8kv_loop(profile: EngineProfile) -> LoopResult:
    return closed_loop(profile, FP8KV_LOAD, 8)


@cache
def ix_loop(profile: EngineProfile) -> LoopResult:
    return closed_loop(profile, IX_LOAD, 10)


# -- the reference points ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ref:
    profile: str
    what: str
    simulate: Callable[[EngineProfile], float]
    value: float  # the reference, in seconds or tokens/s
    rel_tol: float  # |simulated / value − 1| allowed
    kind: str  # 'measured' | 'derived'


def _tpot1(ctx: int) -> Callable[[EngineProfile], float]:
    return lambda p: decode_tpot(p, 1, ctx)


def _ttft(n: int) -> Callable[[EngineProfile], float]:
    return lambda p: single_ttft(p, n)


REFS = [
    # ---- h100-8b: Llama-3.1-8B BF16 on one H100 SXM ----
    # [FP8KV] concurrency-1 ITL fit, BF16 KV: 6.44 ms + 4.37e-5 ms × input_len. ±8%: the fit's
    # residuals are unpublished and b is shared with the concurrency-8 point below.
    Ref("h100-8b", "TPOT batch 1 @1k", _tpot1(1024), 6.485 * MS, 0.08, "measured"),
    Ref("h100-8b", "TPOT batch 1 @8k", _tpot1(8192), 6.798 * MS, 0.08, "measured"),
    Ref("h100-8b", "TPOT batch 1 @32k", _tpot1(32_000), 7.838 * MS, 0.08, "measured"),
    # [FP8KV] Table 4, BF16 KV: 150 requests, ~20k/~2k ±15%, concurrency 8. One run each:
    # TTFT ±15% (prefill split between a and c rests on [FA3]), ITL and throughput ±10%.
    Ref("h100-8b", "median TTFT, 20k prompts @8", lambda p: fp8kv_loop(p).ttft_median,
        763.6 * MS, 0.15, "measured"),
    Ref("h100-8b", "median ITL, 20k prompts @8", lambda p: fp8kv_loop(p).itl_median,
        15.18 * MS, 0.10, "measured"),
    Ref("h100-8b", "output tok/s, 20k prompts @8", lambda p: fp8kv_loop(p).output_rate,
        450.3, 0.10, "measured"),
    # Derived: the 20k TTFT extrapolated along the FLOP model (14.0 GFLOP/token at 609 TFLOP/s,
    # 0.52 MFLOP/pair at 437 TFLOP/s, [FA3]); ±25% for the linear/attention split.
    Ref("h100-8b", "TTFT 1k", _ttft(1024), 31 * MS, 0.25, "derived"),
    Ref("h100-8b", "TTFT 4k", _ttft(4096), 111 * MS, 0.25, "derived"),
    Ref("h100-8b", "TTFT 8k", _ttft(8192), 235 * MS, 0.25, "derived"),
    # Derived (no measurement found): roofline decode step at 256 × 2.6k context, 1.4 ms
    # overhead + max(5.9 ms GEMMs, 5.0 ms weights) + 256·2.6k·128 KiB at 3.0 TB/s (29.2 ms)
    # + 2 ms sampling = 38.5 ms → 6,650 tok/s; ±25%. The additive t0 + a·N form counts the
    # weight read and the GEMMs both, so the simulation is ~15% slow here (docs).
    Ref("h100-8b", "decode tok/s 256 × 2.5k", lambda p: 256 / decode_tpot(p, 256, 2560),
        6650, 0.25, "derived"),

    # ---- h100-8b-fp8: Llama-3.1-8B FP8 weights + FP8 KV on one H100 SXM ----
    # [FP8KV] FP8-KV slope 2.37e-5 ms/token (measured) on an intercept moved from 6.58 ms to
    # 4.27 ms for FP8 weights (7.0 GB less to read at 3.0 TB/s; extrapolated): ±15%.
    Ref("h100-8b-fp8", "TPOT batch 1 @1k", _tpot1(1024), 4.294 * MS, 0.15, "derived"),
    Ref("h100-8b-fp8", "TPOT batch 1 @8k", _tpot1(8192), 4.464 * MS, 0.15, "derived"),
    Ref("h100-8b-fp8", "TPOT batch 1 @32k", _tpot1(32_000), 5.028 * MS, 0.15, "derived"),
    # [MLPERF] Offline, mean 778 in / 73 out, 5,777 output tok/s. ±20%: a tuned submission
    # (batch limits unpublished) against vLLM defaults here, and fixed instead of real lengths.
    Ref("h100-8b-fp8", "offline tok/s 778/73", lambda p: offline_output_rate(p, 3000, 778, 73),
        5777, 0.20, "measured"),
    # Derived as for h100-8b with FP8 GEMMs at 2.0× BF16 speed ([MLPERF]); ±30%.
    Ref("h100-8b-fp8", "TTFT 1k", _ttft(1024), 16.6 * MS, 0.30, "derived"),
    Ref("h100-8b-fp8", "TTFT 4k", _ttft(4096), 61 * MS, 0.30, "derived"),
    Ref("h100-8b-fp8", "TTFT 8k", _ttft(8192), 137 * MS, 0.30, "derived"),

    # ---- h200-30b-a3b: Qwen3-30B-A3B BF16 on one H200 ----
    # Derived from [G2]'s A100 batch-1 TPOT (9.6 ms): its 6.1 ms overhead ×0.65 on Hopper plus
    # the H200 weight read (dense 2.46 GB + 8/128 of 58 GB at 4.08 TB/s) plus 24 ns/ctx token.
    # ±25% (no Hopper batch-1 measurement of this model was found).
    Ref("h200-30b-a3b", "TPOT batch 1 @1k", _tpot1(1024), 5.5 * MS, 0.25, "derived"),
    Ref("h200-30b-a3b", "TPOT batch 1 @8k", _tpot1(8192), 5.7 * MS, 0.25, "derived"),
    Ref("h200-30b-a3b", "TPOT batch 1 @32k", _tpot1(32_000), 6.3 * MS, 0.25, "derived"),
    # [G3] 200 streams 1k→3k on an H200, BF16: 27.8 ms per step for Qwen3.5-35B-A3B, + 7.6 ms
    # for Qwen3-30B-A3B's 96 vs 20 KiB/token of KV, − 1.6 ms for its 6.4 GB fewer expert
    # bytes, − 4.6 ms (3–6) for Qwen3.5's FP32 recurrent state = 29.2 ms. ±25% (a proxy).
    Ref("h200-30b-a3b", "decode step 200 × 1k→3k", lambda p: decode_tpot(p, 200, 1000, 2000),
        29.2 * MS, 0.25, "derived"),
    # Derived: 5.46 GFLOP/token at 496 TFLOP/s (block-FP8 fit from [IX] ÷ 1.8 for BF16) and
    # 0.79 MFLOP/pair at 437 TFLOP/s ([FA3]); ±30%.
    Ref("h200-30b-a3b", "TTFT 1k", _ttft(1024), 20 * MS, 0.30, "derived"),
    Ref("h200-30b-a3b", "TTFT 4k", _ttft(4096), 65 * MS, 0.30, "derived"),
    Ref("h200-30b-a3b", "TTFT 8k", _ttft(8192), 155 * MS, 0.30, "derived"),

    # ---- h200-30b-a3b-fp8: Qwen3-30B-A3B FP8 weights, BF16 KV, on one H200 ----
    # [IX] with the DecodeBenchConnector: 10 streams decoding from 32,768 tokens, TPOT
    # 16.02 ms. ±10% (one run of 20 requests).
    Ref("h200-30b-a3b-fp8", "decode TPOT 10 × 32k", lambda p: decode_tpot(p, 10, 32_768, 100),
        16.02 * MS, 0.10, "measured"),
    # [IX] without the connector (real 32k prefills, concurrency 10): 73.18 output tok/s,
    # TPOT 84.35 ms, TTFT 5,220 ms. Throughput ±12%, TPOT ±15%. Mean TTFT ±30%: over 20
    # requests it depends on how prefills and decodes interleave, which the model does not
    # reproduce as finely as the total work (simulated TTFT is low by ~20%; docs).
    Ref("h200-30b-a3b-fp8", "output tok/s, 32k prompts @10", lambda p: ix_loop(p).output_rate,
        73.18, 0.12, "measured"),
    Ref("h200-30b-a3b-fp8", "mean TPOT, 32k prompts @10", lambda p: ix_loop(p).tpot_mean,
        84.35 * MS, 0.15, "measured"),
    Ref("h200-30b-a3b-fp8", "mean TTFT, 32k prompts @10", lambda p: ix_loop(p).ttft_mean,
        5220 * MS, 0.30, "measured"),
    # Derived as for h200-30b-a3b with FP8 weights (1.53 GB dense, 29 GB experts at 70% of
    # the bandwidth); ±25%.
    Ref("h200-30b-a3b-fp8", "TPOT batch 1 @1k", _tpot1(1024), 4.95 * MS, 0.25, "derived"),
    Ref("h200-30b-a3b-fp8", "TPOT batch 1 @8k", _tpot1(8192), 5.1 * MS, 0.25, "derived"),
    Ref("h200-30b-a3b-fp8", "TPOT batch 1 @32k", _tpot1(32_000), 5.7 * MS, 0.25, "derived"),
    # [G3]'s FP8 run (23.8 ms per step; throughput mode and prefix caching on), corrected as
    # for BF16 (+7.6 KV, −0.9 experts, −4.6 state) = 25.9 ms. ±25%.
    Ref("h200-30b-a3b-fp8", "decode step 200 × 1k→3k", lambda p: decode_tpot(p, 200, 1000, 2000),
        25.9 * MS, 0.25, "derived"),
    # Derived from [IX]'s fit (a = 6 µs, c = 1.8 ns); ±30%.
    Ref("h200-30b-a3b-fp8", "TTFT 1k", _ttft(1024), 14 * MS, 0.30, "derived"),
    Ref("h200-30b-a3b-fp8", "TTFT 4k", _ttft(4096), 44 * MS, 0.30, "derived"),
    Ref("h200-30b-a3b-fp8", "TTFT 8k", _ttft(8192), 114 * MS, 0.30, "derived"),

    # ---- h100x4-70b: Llama-3.1-70B BF16 on four H100 SXM, tensor parallel 4 ----
    # Derived (no measurement found): per GPU a quarter of h100-8b's work at its rates, plus
    # 160 all-reduces per step ([AR-H100] 8 µs, [NVLINK] 370 GB/s). Batch 1: 1.4 ms overhead +
    # 34.75 GB at 3.0 TB/s (11.58 ms) + 160 × 8 µs (1.28 ms) + 8 µs + 66.8 µs + 29.4 ns × ctx.
    # ±25%: the overhead at 80 layers and 4 ranks, and the all-reduce latency, are estimates.
    Ref("h100x4-70b", "TPOT batch 1 @1k", _tpot1(1024), 14.37 * MS, 0.25, "derived"),
    Ref("h100x4-70b", "TPOT batch 1 @8k", _tpot1(8192), 14.58 * MS, 0.25, "derived"),
    Ref("h100x4-70b", "TPOT batch 1 @32k", _tpot1(32_000), 15.27 * MS, 0.25, "derived"),
    # Derived: 34.2 GFLOP/token/GPU at 609 TFLOP/s + 10.6 µs/token of all-reduce, 0.66 MFLOP/pair
    # per GPU at 437 TFLOP/s, one step's fixed 14.3 ms; ±25% (h100-8b's rates, ±20%, and the
    # all-reduce bandwidth).
    Ref("h100x4-70b", "TTFT 1k", _ttft(1024), 83.4 * MS, 0.25, "derived"),
    Ref("h100x4-70b", "TTFT 4k", _ttft(4096), 300.5 * MS, 0.25, "derived"),
    Ref("h100x4-70b", "TTFT 8k", _ttft(8192), 612 * MS, 0.25, "derived"),
    # Derived roofline (as h100-8b's): 1.4 ms + max(14.4 ms GEMMs, 11.6 ms weights) +
    # 256·2.6k·80 KiB at 3.0 TB/s (18.2 ms) + 2 ms sampling + 160 × (8 µs + 6 MiB / 370 GB/s)
    # (4.0 ms) = 40.0 ms → 6,400 tok/s. The additive form counts the weight read and the GEMMs
    # both, 11.6 ms here against h100-8b's 5.0: the simulation is ~25% slow (docs); ±30%.
    Ref("h100x4-70b", "decode tok/s 256 × 2.5k", lambda p: 256 / decode_tpot(p, 256, 2560),
        6400, 0.30, "derived"),
]


def ref_error(ref: Ref, profile: EngineProfile | None = None) -> float:
    """Simulated / reference − 1 (a profile may be passed in to check a perturbed one)."""
    return ref.simulate(profile or get_profile(ref.profile)) / ref.value - 1


@pytest.mark.parametrize("ref", REFS, ids=lambda r: f"{r.profile}: {r.what}")
def test_profile_meets_reference(ref: Ref):
    err = ref_error(ref)
    assert abs(err) <= ref.rel_tol, f"{ref.what}: simulated {err:+.1%} off the {ref.kind} reference"


def _decode_attention(p: EngineProfile) -> float:
    """What 31k more tokens of context add to a decode step of 10 streams (same N, same S)."""
    return decode_tpot(p, 10, 32_000) - decode_tpot(p, 10, 1_000)


def _prefill_attention(p: EngineProfile) -> float:
    """TTFT(16k) − 2·TTFT(8k): two 8k chunks against one, less the shared per-chunk costs,
    leaves the second chunk's attention to the first's 8k of prefix."""
    return single_ttft(p, 16_384) - 2 * single_ttft(p, 8_192)


def test_fp8_weight_variant_keeps_the_bf16_attention_costs():
    # [V2] quantizes the weights only and [IX] leaves kv_cache_dtype at auto: both H200
    # profiles keep a BF16 KV cache and BF16 attention, so the attention that [IX] measured
    # on the FP8 model is also the BF16 profile's (this pins the BF16 profile's b and c).
    bf16, fp8 = get_profile("h200-30b-a3b"), get_profile("h200-30b-a3b-fp8")
    assert _decode_attention(bf16) == pytest.approx(_decode_attention(fp8), rel=0.02)
    assert _prefill_attention(bf16) == pytest.approx(_prefill_attention(fp8), rel=0.02)


def test_fp8_kv_cache_halves_the_decode_attention_cost():
    # [FP8KV]: the FP8-KV ITL slope is 54% of the BF16 one (2.37e-5 vs 4.37e-5 ms/token) on an
    # H100 with Llama-3.1-8B; attention prefill with FP8 KV is "slightly" faster. ±0.08.
    bf16, fp8 = get_profile("h100-8b"), get_profile("h100-8b-fp8")
    assert _decode_attention(fp8) / _decode_attention(bf16) == pytest.approx(0.54, abs=0.08)
    assert 0.85 <= _prefill_attention(fp8) / _prefill_attention(bf16) <= 1.0


def test_every_profile_has_each_kind_of_reference():
    for name in PROFILES:
        whats = " ".join(r.what for r in REFS if r.profile == name)
        assert "TTFT" in whats and "TPOT batch 1" in whats, name
        assert any(k in whats for k in ("200 ×", "256 ×", "offline", "@10")), name


# -- scheduler limits, KV capacity, names --------------------------------------------------

def test_names_the_scenarios_use_still_exist():
    assert {"h200-30b-a3b", "h100-8b", "h200-30b-a3b-fp8", "h100-8b-fp8"} <= set(PROFILES)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_scheduler_limits_are_vllms_defaults_for_h100_and_h200(name):
    # [VLLM-DEF] vllm/engine/arg_utils.py: OPENAI_API_SERVER on a GPU of ≥ 70 GiB that is not
    # an A100 → max_num_batched_tokens 8192, max_num_seqs 1024; block_size 16 on CUDA.
    p = get_profile(name)
    assert (p.max_num_batched_tokens, p.max_num_seqs, p.block_size) == (8192, 1024, 16)


@pytest.mark.parametrize("name, tokens", [
    # (0.9 × GPU memory − weights − activations) / KV bytes per token (profiles.py docstring);
    # ±3%: the activation allowance's ±2 GiB.
    ("h200-30b-a3b", 715_000),  # (126.4 − 56.9 − 4) GiB / 96 KiB
    ("h200-30b-a3b-fp8", 1_019_000),  # (126.4 − 29.1 − 4) GiB / 96 KiB: BF16 KV, as [V2] runs it
    ("h100-8b", 440_000),  # (71.7 − 15.0 − 3) GiB / 128 KiB
    ("h100-8b-fp8", 987_000),  # (71.7 − 8.5 − 3) GiB / 64 KiB (FP8 KV)
    # Per GPU of four: (71.7 − 131.4/4 − 4) GiB / (320 KiB / 4): each GPU keeps 2 of the 8 KV
    # heads of every token, so the engine holds what one GPU's share holds.
    ("h100x4-70b", 456_500),
])
def test_kv_capacity_follows_from_memory(name, tokens):
    assert get_profile(name).kv_tokens == pytest.approx(tokens, rel=0.03)


def test_a_decode_batch_of_an_moe_reads_more_experts_than_a_single_sequence():
    # 64 tokens touch ~98% of the experts against 6% for one: the MoE step grows with the batch
    # far faster than a dense model's (whose weights are read whole at any batch).
    moe, dense = get_profile("h200-30b-a3b"), get_profile("h100-8b")
    assert decode_tpot(moe, 64, 1024) / decode_tpot(moe, 1, 1024) > 2.5
    assert decode_tpot(dense, 64, 1024) / decode_tpot(dense, 1, 1024) < 1.8


# -- tensor parallelism --------------------------------------------------------------------

def _one_gpu_equivalent(tp: EngineProfile) -> EngineProfile:
    """Llama-3.1-70B on one hypothetical H100 with four times the memory, rebuilt here from
    [CFG-L70] and h100-8b's H100 rates (not from the profile's constants): all the weights,
    GEMMs, KV and attention on one GPU, and no all-reduce."""
    read = (70.55e9 - 128_256 * 8192) * 2  # every weight but the input embedding, BF16
    gemm = 2 * 80 * (8192 * (64 + 8 + 8 + 64) * 128 + 3 * 8192 * 28_672)
    return dataclasses.replace(
        tp, t0=1.4e-3 + read / 3.0e12, t_seq=8e-6, a=gemm / 609e12,
        b=47e-9 * (2 * 80 * 8 * 128 * 2) / (128 * 1024), c=4 * 64 * 128 * 80 / 437e12)


def _tp4_surplus(tokens: int) -> float:
    """What a TP-4 step of `tokens` tokens (one sequence each) costs beyond a quarter of the
    one-GPU step: three quarters of the per-step overhead and sampling, which every rank pays
    whole, and 2 × 80 all-reduces of tokens × 8192 BF16 values (8 µs each plus a ring's 3/4 ×
    2 of the bytes over 370 GB/s of NVLink)."""
    allreduce = 160 * (8e-6 + 1.5 * tokens * 8192 * 2 / 370e9)
    return 0.75 * (1.4e-3 + 8e-6 * tokens) + allreduce


@pytest.mark.parametrize("streams, context", [(1, 1024), (1, 32_000), (64, 2048), (256, 2560)])
def test_a_tp_decode_step_costs_a_quarter_of_one_gpus_plus_its_all_reduces(streams, context):
    tp4 = get_profile("h100x4-70b")
    one = _one_gpu_equivalent(tp4)
    step4, step1 = decode_tpot(tp4, streams, context), decode_tpot(one, streams, context)
    assert step4 > step1 / 4  # four GPUs never decode four times as fast
    assert step4 - step1 / 4 == pytest.approx(_tp4_surplus(streams), rel=0.05)


@pytest.mark.parametrize("prompt", [1024, 8192])
def test_a_tp_prefill_costs_a_quarter_of_one_gpus_plus_its_all_reduces(prompt):
    tp4 = get_profile("h100x4-70b")
    one = _one_gpu_equivalent(tp4)
    ttft4, ttft1 = single_ttft(tp4, prompt), single_ttft(one, prompt)
    assert ttft4 > ttft1 / 4
    surplus = _tp4_surplus(prompt) - 0.75 * 8e-6 * (prompt - 1)  # one sequence, not `prompt`
    assert ttft4 - ttft1 / 4 == pytest.approx(surplus, rel=0.05)


def test_tp_shards_the_kv_each_gpu_reads():
    # A decode reads each GPU's 2 of the 8 KV heads: 80 KiB per context token against the
    # 8B's 128 KiB on one GPU, at the same H100 bandwidth.
    tp4, dense = get_profile("h100x4-70b"), get_profile("h100-8b")
    assert _decode_attention(tp4) / _decode_attention(dense) == pytest.approx(80 / 128, rel=0.03)


# -- bulk advancing stays exact with the MoE term ------------------------------------------

@pytest.mark.parametrize("seed", [3, 4])
def test_bulk_advancing_equals_stepping_on_an_moe_profile(seed):
    """The expert-streaming term depends on the batch: the closed-form decode runs must still
    give the step-by-step times (up to rounding), preemptions included."""
    profile = dataclasses.replace(get_profile("h200-30b-a3b").with_kv_tokens(16 * 48), max_num_seqs=8,
                                  max_num_batched_tokens=256)
    rng = np.random.default_rng(seed)

    def run(bulk: bool):
        core = EngineCore(profile, seed=seed, bulk=bulk)
        t = 0.0
        for i in range(14):
            t += float(rng.exponential(0.02))
            n = int(rng.integers(20, 180))
            core.add_request(EngineRequest(f"r{i}", _prompt(n, rng), 120,
                                           output_len=int(rng.integers(5, 120)), arrival_time=t))
        done = {r.request_id: (r.first_token_time, r.finish_time, r.num_output_tokens, r.num_preemptions)
                for r in core.run_until_idle()}
        return done, core.stats()

    rng_state = rng.bit_generator.state
    step, s_step = run(False)
    rng.bit_generator.state = rng_state
    bulk, s_bulk = run(True)
    assert s_step.num_preemptions_total > 0
    assert step.keys() == bulk.keys()
    for rid, (first, fin, n, pre) in step.items():
        bfirst, bfin, bn, bpre = bulk[rid]
        assert (bn, bpre) == (n, pre), rid
        assert bfirst == pytest.approx(first, rel=1e-12) and bfin == pytest.approx(fin, rel=1e-12), rid
    assert s_bulk.steps_total == s_step.steps_total
    assert s_bulk.busy_time == pytest.approx(s_step.busy_time, rel=1e-12)
