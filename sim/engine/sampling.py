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


# Sampled-token logprobs. A language model sampling at temperature 1 is mostly confident with a
# heavy tail: per-token entropy of 0.3-0.6 nats is typical of RL rollouts. Here a token is
# "confident" with probability 0.7 (logprob −0.05·E) and "uncertain" otherwise (−1.5·E), E a
# unit exponential: a mean of about −0.49 nats per token. Like the ids, they are a pure function
# of the request's seed and the position, so a recomputed request reports the same values.
_CONFIDENT_SHARE = 0.7
_CONFIDENT_SCALE = 0.05
_UNCERTAIN_SCALE = 1.5
_LOGPROB_FLOOR = -30.0


def _uniforms(seed: int, start: int, stop: int, stream: int) -> np.ndarray:
    pos = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(pos ^ (np.uint64(seed) * np.uint64(stream)))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def output_logprobs(seed: int, start: int, stop: int) -> list[float]:
    """Logprobs (natural log, ≤ 0) of the tokens sampled at output positions [start, stop)."""
    if stop <= start:
        return []
    u = _uniforms(seed, start, stop, 0x8CB92BA72F3D8DD7)
    kind = _uniforms(seed, start, stop, 0xA0761D6478BD642F)
    scale = np.where(kind < _CONFIDENT_SHARE, _CONFIDENT_SCALE, _UNCERTAIN_SCALE)
    lp = np.maximum(scale * np.log1p(-u), _LOGPROB_FLOOR)
    return lp.tolist()


def top_alternatives(seed: int, position: int, sampled_id: int, sampled_logprob: float, k: int,
                     vocab_size: int) -> list[tuple[int, float]]:
    """The k most likely tokens at `position` besides the sampled one, most likely first: the
    probability mass the sampled token leaves, (1 − p), split as (1 − p)/2, (1 − p)/4, ... over
    distinct ids, so the sampled token and its alternatives never sum above 1."""
    if k <= 0:
        return []
    rest = -math.expm1(sampled_logprob)  # 1 − p, computed without cancellation
    pos = np.uint64(position) * np.uint64(64) + np.arange(k + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(pos ^ (np.uint64(seed) * np.uint64(0xE7037ED1A0B428DB)))
    span = np.uint64(vocab_size - FIRST_GENERATED_ID)
    ids = [i for i in (h % span + np.uint64(FIRST_GENERATED_ID)).astype(np.int64).tolist()
           if i != sampled_id][:k]
    out = []
    for j, tid in enumerate(ids, start=1):
        p = rest * 0.5**j
        out.append((tid, math.log(p) if p > 0 else _LOGPROB_FLOOR))
    return out
