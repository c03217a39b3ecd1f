"""Engine profiles: GPUs × model, its KV capacity, scheduler limits and step-time model.

Step time for one scheduler step (docs/engine-model.md):

    T = t0 + t_seq·S + L(N) + b·Σ_decode ctx + c·Σ_prefill chunk·(prefix + chunk/2)
    L(N) = a·N                                                   (dense models)
    L(N) = max(a·N, moe_stream·(1 − (1 − moe_topk_frac)^N))       (mixture-of-experts models)

S = sequences in the batch, N = tokens scheduled, ctx = tokens already in KV for a decode,
prefix = tokens already in KV before a prefill chunk. t0 is the fixed per-step cost (kernel
launches, scheduler and sampler overhead, and streaming the weights every step reads:
all of a dense model's, the non-expert part of an MoE's), t_seq per-sequence sampling/logits,
a the per-token cost of the linear layers, b the per-context-token attention read of a decode
(KV bytes / achieved HBM bandwidth), c the per-(query, key) attention cost of prefill.
For an MoE, a step also streams the routed experts its N tokens touch: with uniform routing of
top-k of E experts, the expected fraction touched is 1 − (1 − k/E)^N (6% at N = 1, 98% at
N = 64 for Qwen3-30B-A3B). That read overlaps the expert GEMMs, hence the max(): decode
steps are bandwidth-bound, prefill chunks compute-bound. A single constant t0 cannot give both
the batch-1 TPOT and a large-batch step for an MoE (at N ≥ 64 every step must read all
expert weights, 58 GB in BF16: ≥ 12 ms on an H200), which is why L(N) has this term.
docs/engine-model.md has the reference table, the simulated values and the errors.

Sources (keys used here, in the docs and in tests/sim/test_profiles.py):
- [HW-H100] NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 1,979 FP8, 3.35 TB/s HBM3,
  80 GB (nvidia-smi: 81,559 MiB = 79.6 GiB). [HW-H200] H200 SXM: the same compute,
  4.8 TB/s HBM3e, 141 GB (nvidia-smi: 143,771 MiB = 140.4 GiB).
- [CFG-Q] huggingface.co/Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 query /
  4 KV heads of 128, 128 experts, top-8, expert width 768, vocab 151,936, untied embeddings
  → 30.5B parameters (56.9 GiB BF16 [G1]), of which routed experts 29.0B; 2.73B active linear
  parameters per token (5.46 GFLOP); KV 2·48·4·128·2 B = 96 KiB/token; attention
  4·32·128·48 = 0.79 MFLOP per (query, key) pair.
- [CFG-L] huggingface.co/meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096,
  32 query / 8 KV heads of 128, MLP 14,336, vocab 128,256 → 8.03B parameters (15.0 GiB BF16);
  14.0 GFLOP per prefill token; KV 128 KiB/token; 0.52 MFLOP per (query, key) pair.
- [FP8KV] vLLM blog "The State of FP8 KV-Cache and Attention Quantization in vLLM"
  (vllm-project/vllm-project.github.io, _posts/2026-04-22-fp8-kvcache.md), one H100, vLLM
  0.19.1 + FlashAttention-3, Llama-3.1-8B BF16 weights: concurrency-1 ITL = 6.44 ms +
  4.37e-5 ms × input_len (BF16 KV), 6.58 ms + 2.37e-5 ms × input_len (FP8 KV); 150 requests
  at concurrency 8, ~20k in / ~2k out (±15%): BF16 KV median TTFT 763.6 ms, median ITL
  15.18 ms, 672.6 s, 450.3 output tok/s.
- [IX] SemiAnalysisAI/InferenceX pull request #769 (vLLM DecodeBenchConnector experiment),
  one H200 SXM, Qwen/Qwen3-30B-A3B-FP8 TP1 (KV cache dtype left at auto = BF16), 20 random
  32,768-token prompts, 100 outputs, concurrency 10: with the connector (prefill skipped, KV
  filled) TPOT 16.02 ms; without it TTFT 5,220 ms, TPOT 84.35 ms, 73.18 output tok/s.
- [MLPERF] Red Hat's MLPerf Inference v5.1 Llama-3.1-8B submission (redhat.com/en/blog/
  efficient-and-reproducible-llm-inference-red-hat-mlperf-inference-v51-results): FP8 weights
  and KV, vLLM 0.10.0, one H100, CNN-DailyMail (mean 778 in / 73 out): Offline 5,777 tok/s.
- [FA3] FlashAttention-3 (arXiv 2407.08608, Fig. 5): BF16 forward, head dim 128, on H100 SXM5
  runs at 600–650 TFLOP/s for 4k–16k sequences.
- [G2] (WORKLOADS.md) tenstorrent/tt-inference-server issue 340: Qwen3-30B-A3B on A100, vLLM,
  batch 1: TPOT 9.6 ms at 128 input tokens, 10.6 ms at 8,192. Its TTFTs are NOT used: 75.2 ms
  for 4,096 tokens is 29 TFLOP of work, which needs ≥ 93 ms at the A100's 312 TFLOP/s peak,
  so those rows cannot be cold prefills (cached prefixes or shorter prompts).
- [G3] (WORKLOADS.md) gpustack docs/performance-lab/qwen3.5-35b-a3b/h200.md, vLLM 0.17.1,
  200 requests × 1,000 in / 2,000 out at once: BF16 57.74 s, mean latency 57.43 s, mean TTFT
  1.92 s → 27.8 ms per decode step at 200 streams (FP8 with throughput mode: 23.8 ms). A
  different, hybrid-attention model: used only after the architecture correction below.
- [V2] (WORKLOADS.md) volcengine/verl recipe/dapo/run_dapo_qwen3_moe_30b_vllm_fp8_rollout.sh:
  rollout.quantization.weight_dtype=fp8 (weights only; KV cache stays BF16), gen_tp=1,
  gpu_memory_utilization 0.9, max_num_batched_tokens 32768, max_num_seqs 256.
- [VLLM-DEF] vllm-project/vllm vllm/engine/arg_utils.py (EngineArgs._set_default_args at
  commit 99d7eb5d; EngineArgs.get_batch_defaults in later versions): for usage context
  OPENAI_API_SERVER on a GPU with ≥ 70 GiB whose name does not contain "a100" (H100, H200),
  max_num_batched_tokens 8192 and max_num_seqs 1024 (LLM_CLASS: 16384 and 1024); otherwise
  (A100, smaller GPUs) 2048 and 256 (LLM_CLASS: 8192 and 256). block_size defaults to 16.
- [CFG-L70] huggingface.co/meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192,
  64 query / 8 KV heads of 128, MLP 28,672, vocab 128,256, untied embeddings → 70.55B
  parameters (131.4 GiB BF16); 136.9 GFLOP per prefill token; KV 2·80·8·128·2 B = 320 KiB per
  token; 2.62 MFLOP per (query, key) pair.
- [NVLINK] NVIDIA H100 SXM5 datasheet: fourth-generation NVLink, 900 GB/s per GPU in both
  directions together (450 GB/s each way). NVIDIA's NCCL maintainer in NVIDIA/nccl-tests issue
  212: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
  NVLink bandwidth of 370GB/s" (ring bus bandwidth).
- [AR-H100] sgl-project/sglang pull request 2904, vLLM's custom all-reduce on H100s, TP 2/4/8,
  without CUDA graphs: at TP 4, 8.5–9.2 µs for 512 B–32 KiB, 20.6 µs at 256 KiB, 26.9 µs at
  512 KiB, 40.2 µs at 1 MiB.

Derivations and error bars (an error bar says how far the real GPU may plausibly be):
- KV capacity: (0.9 × GPU memory − weights − activations) / KV bytes per token; activations
  (profiled peak of a max_num_batched_tokens forward, sampler buffers, non-torch memory)
  4 GiB for the MoE, 3 GiB for the 8B (±2 GiB → ±3% on capacity). h200-30b-a3b:
  (126.4 − 56.9 − 4) GiB / 96 KiB = 715k; FP8 weights (29.1 GiB), BF16 KV: 1.02M;
  h100-8b: (71.7 − 15.0 − 3) GiB / 128 KiB = 440k; FP8 weights (8.5 GiB) and KV: 987k.
- b: [FP8KV]'s batch-1 ITL slope is 43.7 ns per 128 KiB token on an H100 (90% of 3.35 TB/s);
  its concurrency-8 median ITL implies ~50 ns; h100-8b takes 47 ns (±10%), h100-8b-fp8 25 ns
  (slope 23.7 ns). For the H200 the same FA3 kernel at 85% of 4.8 TB/s gives 96 KiB / 4.08
  TB/s = 24 ns (±15%), which reproduces [IX]'s decode-only 16.02 ms within 3%.
- c: [FA3]'s ~630 TFLOP/s kernel rate at 69% for vLLM's chunked, paged, variable-length
  prefill (437 TFLOP/s, fitted with a to [IX]'s 32k run): c = 0.79 MFLOP / 437 T = 1.8 ns
  (Qwen), 0.52 MFLOP / 437 T = 1.2 ns (Llama); ±25%. FP8 KV: 5% less ([FP8KV]: "slight TTFT
  speedups"). Both H200 profiles keep a BF16 KV cache, so they share b and c.
- a: h200-30b-a3b-fp8 fitted with c to [IX]'s 32k run: 6 µs (5.46 GFLOP at 910 TFLOP/s, 46%
  of FP8 peak); h200-30b-a3b 11 µs (50% of BF16 peak: block-FP8 MoE GEMMs ~1.8× faster;
  ±30%); h100-8b 23 µs from [FP8KV]'s 20k median TTFT once c is fixed (14.0 GFLOP at 609
  TFLOP/s, 62%; ±20%); h100-8b-fp8 11.5 µs from [MLPERF] (±25%).
- t0: fixed launch/scheduler overhead plus the weights every step reads. h100-8b: [FP8KV]'s
  6.44 ms intercept less t_seq and a = 6.41 ms (overhead 1.4 ms + 15.0 GB at 3.0 TB/s);
  h100-8b-fp8: 6.58 ms (FP8-KV intercept) less 7.0 GB of weights not read = 4.25 ms (±15%).
  H200 MoE: 4.0 ms overhead (±1 ms: [G2]'s A100 9.6 ms less its 3.5 ms weight read, ×0.65
  for Hopper clocks and a newer vLLM) + 2.46 GB (BF16) or 1.53 GB (FP8) of non-expert weights
  at 4.08 TB/s. No Hopper batch-1 measurement of Qwen3-30B-A3B was found: batch-1 TPOT on
  the H200 (5.5 ms BF16, 4.95 ms FP8 at 1k) is an extrapolation, ±25%.
- moe_stream: every routed expert's bytes once, 58.0 GB (BF16) at 85% of 4.8 TB/s = 14.2 ms;
  29.0 GB (FP8) at 70% = 8.6 ms: [G3]'s FP8 run gains only 4 of the 8 ms that halving the
  expert bytes would save, so block-FP8 expert kernels stream below the BF16 ones.
- [G3] → Qwen3-30B-A3B: 27.8 ms + 7.6 ms (96 vs 20 KiB/token of KV at Σctx = 400k) − 1.6 ms
  (6.4 GB fewer expert bytes) − 4.6 ms (3–6 ms: Qwen3.5's FP32 recurrent state, read and
  written each step) = 29.2 ms per step (BF16; FP8 25.9 ms), ±25%.
- t_seq: logits (vocab × hidden) and sampling per sequence, ~10 µs (±50%; no reference
  separates it from t0 and b).
- Tensor parallelism (h100x4-70b: Llama-3.1-70B on four H100s, TP 4). Each GPU holds a
  quarter of every weight matrix and of the KV heads (8 KV heads, 2 per GPU: none replicated),
  so the single-GPU roofline above applies per GPU to a quarter of the work, with the rates the
  8B calibration found on an H100: 34.75 GB of weights per GPU read per step at 3.0 TB/s
  (11.6 ms), 34.2 GFLOP per token per GPU at 609 TFLOP/s (56.2 µs), 80 KiB of KV per context
  token per GPU at h100-8b's 47 ns per 128 KiB (29.4 ns), 0.66 MFLOP per (query, key) pair per
  GPU at 437 TFLOP/s (1.50 ns), h100-8b's 1.4 ms of per-step overhead and 8 µs of t_seq. On
  top of that, the all-reduces TP adds: two per layer (after attention's output projection and
  after the MLP), 160 per step, each of N × hidden × 2 B. An all-reduce costs a latency plus a
  ring's 2(tp − 1)/tp of its bytes over each GPU's NVLink: 8 µs ([AR-H100], small messages;
  ±50%: CUDA graphs shorten it, larger steps lengthen it) and 370 GB/s ([NVLINK]), so
  160 × 8 µs = 1.28 ms per step (in t0) and 160 × 1.5 × 16 KiB / 370 GB/s = 10.6 µs per
  token (in a). vLLM does not overlap them with compute, hence additive. Known error: at 16–64
  tokens per step (256 KiB–1 MiB messages) [AR-H100] measured 21–40 µs per all-reduce where
  this line gives 9–12 µs, so decode steps of that size are up to ~4 ms (~20%) too short.
  KV capacity per GPU: (71.7 − 32.9 − 4) GiB / 80 KiB = 456k tokens, the engine's capacity
  (each token's KV spans the four GPUs); activations 4 GiB per GPU (the 8B's 3 GiB plus NCCL
  and custom all-reduce buffers; ±2 GiB → ±6%).
Scheduler limits are [VLLM-DEF]'s online-serving defaults for an H100/H200: 8192 batched tokens,
1024 sequences, block 16. RL frameworks often override them ([V2]: 32768 and 256).
End-of-sequence model (when a request gives no length): lognormal output length, median
`eos_median` tokens, log-sigma `eos_sigma`, capped by max_tokens (a chat-like default; RL
scenarios always pass true lengths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GiB = 1 << 30
H100_MEM_GIB = 81_559 / 1024  # nvidia-smi total of an H100 SXM5 80GB [HW-H100]
H200_MEM_GIB = 143_771 / 1024  # nvidia-smi total of an H200 SXM 141GB [HW-H200]
H100_BW = 3.35e12  # B/s [HW-H100]
H200_BW = 4.8e12  # B/s [HW-H200]
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def kv_tokens_from_memory(mem_gib: float, weights_gib: float, activations_gib: float,
                          kv_bytes_per_token: int) -> int:
    """KV capacity as vLLM sizes it: what gpu_memory_utilization leaves after the weights and
    the profiled activation peak, in whole tokens."""
    free = (GPU_MEMORY_UTILIZATION * mem_gib - weights_gib - activations_gib) * GiB
    return int(free // kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    served_model: str  # the id /v1/models reports
    kv_tokens: int  # KV capacity in tokens (num_gpu_blocks × block_size)
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    vocab_size: int = 151_936
    t0: float = 8e-3  # s per step
    t_seq: float = 10e-6  # s per sequence in the batch
    a: float = 15e-6  # s per scheduled token (linear layers)
    b: float = 21e-9  # s per decode context token
    c: float = 2.6e-9  # s per prefill (query, key) pair
    moe_stream: float = 0.0  # s to stream every routed expert's weights once (0: dense model)
    moe_topk_frac: float = 0.0  # experts a token activates / experts per layer (k/E)
    eos_median: int = 600
    eos_sigma: float = 1.0

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    def linear_time(self, n_tokens: int) -> float:
        """L(N): the linear layers of a step with N scheduled tokens (see the module docstring).
        Dense: a·N. MoE: the larger of the GEMM time and streaming the experts the N tokens
        touch (uniform top-k routing)."""
        if not self.moe_stream or n_tokens <= 0:
            return self.a * n_tokens
        touched = -math.expm1(n_tokens * math.log1p(-self.moe_topk_frac))
        return max(self.a * n_tokens, self.moe_stream * touched)

    def with_limits(self, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None) -> EngineProfile:
        """The profile with the scheduler limits a deployment sets (None: keep vLLM's)."""
        return replace(self, max_num_seqs=max_num_seqs or self.max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens or self.max_num_batched_tokens)

    def with_kv_tokens(self, kv_tokens: int | None) -> EngineProfile:
        if kv_tokens is None:
            return self
        if kv_tokens < self.block_size * 2:
            raise ValueError(f"kv_tokens: must be at least {self.block_size * 2}, got {kv_tokens}")
        return replace(self, kv_tokens=kv_tokens)


# -- derived constants (module docstring: "Derivations") ---------------------------------------
_Q_KV_BYTES = 2 * 48 * 4 * 128 * 2  # 98,304 B = 96 KiB per token [CFG-Q]
_L_KV_BYTES = 2 * 32 * 8 * 128 * 2  # 131,072 B = 128 KiB per token (BF16) [CFG-L]
_Q_EXPERT_BYTES_BF16 = 48 * 128 * 3 * 2048 * 768 * 2  # 57.98 GB of routed experts [CFG-Q]
_Q_EXPERT_BYTES_FP8 = _Q_EXPERT_BYTES_BF16 // 2  # 28.99 GB (+ block scales, < 0.1%)
_Q_DENSE_BYTES_BF16 = 2.46e9  # attention, router, lm_head: 1.23B params × 2 B [CFG-Q]
_Q_DENSE_BYTES_FP8 = 1.53e9  # attention in FP8 (0.91 GB), lm_head and router in BF16
_H200_OVERHEAD = 4.0e-3  # launch + scheduler + sampler per step, Qwen3-30B-A3B on an H200
_H200_ETA = 0.85  # achieved fraction of HBM bandwidth when streaming weights / KV
_H200_ETA_FP8_MOE = 0.70  # block-FP8 expert kernels at small M (see the docstring: [G3], [IX])

# What the h100-8b calibration says one H100 achieves (docstring: t0, a, b, c), reused per GPU
# for a tensor-parallel engine.
_H100_OVERHEAD = 1.4e-3  # s per step: launches, scheduler, sampler
_H100_WEIGHT_BW = 3.0e12  # B/s streaming weights
_H100_GEMM_RATE = 609e12  # FLOP/s in BF16 GEMMs
_H100_ATTN_RATE = 437e12  # FLOP/s in chunked, paged prefill attention ([FA3] × 0.69)
_H100_KV_READ = 47e-9 / _L_KV_BYTES  # s per KV byte a decode reads (h100-8b's b)
_AR_LATENCY = 8e-6  # s per all-reduce of a small message, TP 4 on H100s [AR-H100]
_NVLINK_BUS_BW = 370e9  # B/s a ring all-reduce moves over each H100's NVLink [NVLINK]

# Llama-3.1-70B [CFG-L70]
_L70_LAYERS, _L70_HIDDEN = 80, 8192
_L70_KV_BYTES = 2 * 80 * 8 * 128 * 2  # 327,680 B = 320 KiB per token, all ranks together
_L70_WEIGHTS_GIB = 131.42  # 70.55B parameters × 2 B
_L70_READ_BYTES = 139.0e9  # what every step reads: all but the input embedding, 69.5B × 2 B
_L70_GEMM_FLOP = 136.9e9  # per token: 2 × 68.45B linear parameters (no embeddings, no lm_head)
_L70_ATTN_FLOP = 4 * 64 * 128 * 80  # per (query, key) pair: 2.62 MFLOP


def tp_allreduce_cost(tp: int, layers: int, hidden: int) -> tuple[float, float]:
    """(s per step, s per scheduled token) that tensor parallelism's all-reduces add to a
    dense model's step: two per layer (attention output, MLP output) of N × hidden BF16
    values each, every one paying `_AR_LATENCY` and moving a ring's 2(tp − 1)/tp of its bytes
    over each GPU's NVLink. vLLM runs them between the GEMMs, not overlapped, so they add."""
    if tp == 1:
        return 0.0, 0.0
    n = 2 * layers
    wire_bytes_per_token = 2 * (tp - 1) / tp * hidden * 2
    return n * _AR_LATENCY, n * wire_bytes_per_token / _NVLINK_BUS_BW


_L70_TP4_STEP, _L70_TP4_TOKEN = tp_allreduce_cost(4, _L70_LAYERS, _L70_HIDDEN)  # 1.28 ms, 10.6 µs

PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile(
            name="h200-30b-a3b",  # Qwen3-30B-A3B, BF16 weights and KV, one H200
            served_model="sim-qwen3-30b-a3b",
            kv_tokens=kv_tokens_from_memory(H200_MEM_GIB, 56.87, 4.0, _Q_KV_BYTES),  # ≈ 715k
            max_model_len=65_536,
            vocab_size=151_936,
            t0=_H200_OVERHEAD + _Q_DENSE_BYTES_BF16 / (_H200_ETA * H200_BW),  # 4.6 ms
            t_seq=10e-6, a=11e-6, b=24e-9, c=1.8e-9,
            moe_stream=_Q_EXPERT_BYTES_BF16 / (_H200_ETA * H200_BW), moe_topk_frac=8 / 128,
        ),
        EngineProfile(
            name="h200-30b-a3b-fp8",  # Qwen3-30B-A3B, FP8 (block) weights, BF16 KV, one H200
            served_model="sim-qwen3-30b-a3b-fp8",
            kv_tokens=kv_tokens_from_memory(H200_MEM_GIB, 29.1, 4.0, _Q_KV_BYTES),  # ≈ 1.02M
            max_model_len=65_536,
            vocab_size=151_936,
            t0=_H200_OVERHEAD + _Q_DENSE_BYTES_FP8 / (_H200_ETA * H200_BW),  # 4.4 ms
            t_seq=10e-6, a=6e-6, b=24e-9, c=1.8e-9,
            moe_stream=_Q_EXPERT_BYTES_FP8 / (_H200_ETA_FP8_MOE * H200_BW), moe_topk_frac=8 / 128,
        ),
        EngineProfile(
            name="h100-8b",  # Llama-3.1-8B, BF16 weights and KV, one H100 SXM 80GB
            served_model="sim-llama3-8b",
            kv_tokens=kv_tokens_from_memory(H100_MEM_GIB, 14.96, 3.0, _L_KV_BYTES),  # ≈ 440k
            max_model_len=32_768,
            vocab_size=128_256,
            t0=6.41e-3, t_seq=8e-6, a=23e-6, b=47e-9, c=1.2e-9,
        ),
        EngineProfile(
            name="h100-8b-fp8",  # Llama-3.1-8B, FP8 weights (W8A8) and FP8 KV, one H100 SXM 80GB
            served_model="sim-llama3-8b-fp8",
            kv_tokens=kv_tokens_from_memory(H100_MEM_GIB, 8.46, 3.0, _L_KV_BYTES // 2),  # ≈ 986k
            max_model_len=32_768,
            vocab_size=128_256,
            t0=4.25e-3, t_seq=8e-6, a=11.5e-6, b=25e-9, c=1.14e-9,
        ),
        EngineProfile(
            name="h100x4-70b",  # Llama-3.1-70B, BF16 weights and KV, four H100 SXM 80GB, TP 4
            served_model="sim-llama3-70b",
            # per GPU: a quarter of the weights, 2 of the 8 KV heads (80 KiB per token) ≈ 456k
            kv_tokens=kv_tokens_from_memory(H100_MEM_GIB, _L70_WEIGHTS_GIB / 4, 4.0,
                                            _L70_KV_BYTES // 4),
            max_model_len=32_768,
            vocab_size=128_256,
            t0=_H100_OVERHEAD + _L70_READ_BYTES / 4 / _H100_WEIGHT_BW + _L70_TP4_STEP,  # 14.3 ms
            t_seq=8e-6,
            a=_L70_GEMM_FLOP / 4 / _H100_GEMM_RATE + _L70_TP4_TOKEN,  # 66.8 µs
            b=_H100_KV_READ * _L70_KV_BYTES / 4,  # 29.4 ns
            c=_L70_ATTN_FLOP / 4 / _H100_ATTN_RATE,  # 1.50 ns
        ),
    )
}


def check_engine_options(time_scale: float, kv_tokens: int | None) -> None:
    """Raise ValueError("<field>: ...") for a clock scale or KV size no simulated engine can run
    with (the commands that start one check them before they start anything)."""
    if not time_scale > 0:
        raise ValueError(f"time_scale: {time_scale:g} must be more than 0")
    if kv_tokens is not None and kv_tokens < 1:
        raise ValueError(f"kv_tokens: {kv_tokens} must be at least 1")


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"profile: unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
