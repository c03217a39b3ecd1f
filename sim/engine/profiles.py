"""Engine profiles: a GPU × model pair, its KV capacity, scheduler limits and step-time model.

Step time (DESIGN §5) for one scheduler step:

    T = t0 + t_seq·S + a·N + b·Σ_decode ctx + c·Σ_prefill chunk·(prefix + chunk/2)

S = sequences in the batch, N = tokens scheduled, ctx = tokens already in KV for a decode,
prefix = tokens already in KV before a prefill chunk. t0 is the fixed per-step cost (launch,
MoE routing, CUDA-graph replay), t_seq per-sequence sampling/logits, a the per-token
weight-bound cost, b the per-context-token attention read (KV bytes / HBM bandwidth), c the
per-(query, key) attention FLOPs of prefill.

Sources and derivations (error bars are honest guesses of how far the real GPU may differ):
- h200-30b-a3b (Qwen3-30B-A3B BF16 on one H200): weights 56.9 GB, KV 96 KiB/token [G1]
  → (0.9·141 GB − 56.9 GB − ~3 GB activations) / 96 KiB ≈ 690k KV tokens. Decode fit from
  WORKLOADS.md §4: 8 ms + 0.08 ms per running sequence at 2–3K context ([G2] 9.6 ms @1,
  [G3] ~24 ms @200 streams) — split as t_seq 10 µs + a 15 µs + b·2.5K with b = 96 KiB /
  4.8 TB/s ≈ 21 ns. Prefill: a ≈ 15 µs/token (3.3B active params → 6.6 GFLOP/token at
  ~45% of 989 TFLOP/s); c = 4·d_model_attn·layers = 4·4096·48 ≈ 0.79 MFLOP per (q, k) pair
  at ~300 TFLOP/s ≈ 2.6 ns. Error bars: t0 ±30%, a ±50%, b ±30%, c ±50%.
- h100-8b (Llama-3-8B class dense BF16 on one H100 80GB): weights 16 GB, KV 128 KiB/token
  (32 layers × 8 KV heads × 128 × 2 × 2 B) → (0.9·80 − 16 − 3) GB / 128 KiB ≈ 400k tokens.
  a = 16 GFLOP/token at ~600 TFLOP/s ≈ 27 µs; b = 128 KiB / 3.35 TB/s ≈ 39 ns;
  c = 4·4096·32 ≈ 0.52 MFLOP/pair at ~500 TFLOP/s ≈ 1.05 ns; t0 6 ms, t_seq 8 µs.
  Error bars as above (no public concurrency sweep was found for either pair).
Scheduler limits are vLLM's defaults for online serving on these GPUs:
max_num_batched_tokens 8192, max_num_seqs 256, block_size 16.
End-of-sequence model (when a request gives no length): lognormal output length, median
`eos_median` tokens, log-sigma `eos_sigma`, capped by max_tokens (a chat-like default; RL
scenarios always pass true lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    served_model: str  # the id /v1/models reports
    kv_tokens: int  # KV capacity in tokens (num_gpu_blocks × block_size)
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    vocab_size: int = 151_936
    t0: float = 8e-3  # s per step
    t_seq: float = 10e-6  # s per sequence in the batch
    a: float = 15e-6  # s per scheduled token
    b: float = 21e-9  # s per decode context token
    c: float = 2.6e-9  # s per prefill (query, key) pair
    eos_median: int = 600
    eos_sigma: float = 1.0

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    def with_kv_tokens(self, kv_tokens: int | None) -> EngineProfile:
        if kv_tokens is None:
            return self
        if kv_tokens < self.block_size * 2:
            raise ValueError(f"kv_tokens: must be at least {self.block_size * 2}, got {kv_tokens}")
        return replace(self, kv_tokens=kv_tokens)


PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile(
            name="h200-30b-a3b",
            served_model="sim-qwen3-30b-a3b",
            kv_tokens=690_000,
            max_model_len=65_536,
            vocab_size=151_936,
            t0=8e-3, t_seq=10e-6, a=15e-6, b=21e-9, c=2.6e-9,
        ),
        EngineProfile(
            name="h100-8b",
            served_model="sim-llama3-8b",
            kv_tokens=400_000,
            max_model_len=32_768,
            vocab_size=128_256,
            t0=6e-3, t_seq=8e-6, a=27e-6, b=39e-9, c=1.05e-9,
        ),
    )
}


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"profile: unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
