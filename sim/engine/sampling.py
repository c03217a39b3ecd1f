"""Deterministic stand-ins for sampling: output token ids and end-of-sequence lengths.

Token ids are counter-based (a splitmix64 hash of the request's seed and the position), so any
range of positions can be produced on its own and a request preempted and recomputed emits the
same tokens again. Nothing here depends on call order.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
# Ids below this are reserved for byte tokens and specials of the simulated tokenizer, so
# generated text detokenizes to word-like pieces.
FIRST_GENERATED_ID = 512


def request_seed(engine_seed: int, request_id: str, seed: int | None) -> int:
    """A 63-bit seed per request: its own `seed` if given (as vLLM's per-request seed), else
    derived from the request id and the engine seed."""
    base = seed if seed is not None else zlib.crc32(request_id.encode())
    return ((engine_seed * 0x9E3779B97F4A7C15) ^ (base * 0xBF58476D1CE4E5B9)) & 0x7FFFFFFFFFFFFFFF


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def output_token_ids(seed: int, start: int, stop: int, vocab_size: int) -> list[int]:
    """Token ids at output positions [start, stop) of the request with this seed."""
    if stop <= start:
        return []
    pos = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(pos ^ (np.uint64(seed) * np.uint64(0xD6E8FEB86659FD93)))
    span = np.uint64(vocab_size - FIRST_GENERATED_ID)
    return (h % span + np.uint64(FIRST_GENERATED_ID)).astype(np.int64).tolist()


def eos_length(seed: int, median: int, sigma: float) -> int:
    """A lognormal output length (≥ 1) for a request that gave none."""
    u = (int(_splitmix64(np.array([seed ^ 0x5DEECE66D], dtype=np.uint64))[0]) >> 11) / float(1 << 53)
    u = min(max(u, 1e-12), 1 - 1e-12)
    z = math.sqrt(2.0) * _erfinv(2.0 * u - 1.0)
    return max(1, int(round(median * math.exp(sigma * z))))


def _erfinv(y: float) -> float:
    # Newton iterations on erf from a good starting point; |y| < 1.
    x = math.copysign(math.sqrt(-math.log((1 - y) * (1 + y))), y) * 0.8862269254527580
    for _ in range(30):
        err = math.erf(x) - y
        x -= err / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
        if abs(err) < 1e-15:
            break
    return x
