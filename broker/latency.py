"""Session latency (enqueued → result published) as per-workload bucket counters.

finish.lua counts each published result in the namespace's `kvsec` hash under
`lat:<workload>:<i>`, where bucket i holds latencies in (2^((i-1)/2), 2^(i/2)] seconds: i is
ceil(2·log2(latency)), clamped to [MIN_BUCKET, OVERFLOW]; MIN_BUCKET holds everything up to
7.8 ms and OVERFLOW everything above 2^12 s (68 min). √2-wide buckets bound a quantile's error
to that factor; the counters only grow, so any window's quantiles come from the difference of
two reads (what the status API does), as Prometheus's `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MIN_BUCKET = -14  # ≤ 2^-7 s (7.8 ms)
OVERFLOW = 25  # > 2^12 s; keep in step with finish.lua
PREFIX = "lat:"


def upper_bound_s(i: int) -> float:
    """The largest latency bucket i holds (inf for the overflow bucket)."""
    return math.inf if i >= OVERFLOW else 2.0 ** (i / 2)


def bucket_of(latency_s: float) -> int:
    """The bucket finish.lua counts a latency in (for tests and documentation)."""
    if latency_s <= 0:
        return MIN_BUCKET
    return max(MIN_BUCKET, min(OVERFLOW, math.ceil(2 * math.log2(latency_s) - 1e-9)))


def parse_counters(fields: Mapping[str, str]) -> dict[str, int]:
    """The `lat:` fields of the kvsec hash, as "<workload>:<i>" -> count."""
    return {f[len(PREFIX):]: int(v) for f, v in fields.items() if f.startswith(PREFIX)}


def by_workload(counts: Mapping[str, int]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for key, n in counts.items():
        w, _, i = key.rpartition(":")
        if n > 0:
            out.setdefault(w, {})[int(i)] = n
    return out


def quantiles(buckets: Mapping[int, int], qs: Sequence[float]) -> list[float] | None:
    """Each quantile q of the latencies counted in `buckets` (bucket -> count), interpolated
    linearly inside its bucket; a quantile in the overflow bucket is its lower bound. None when
    nothing was counted."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    order = sorted(buckets)
    out = []
    for q in qs:
        rank = q * total
        seen = 0
        for i in order:
            n = buckets[i]
            if seen + n >= rank:
                lo = 0.0 if i <= MIN_BUCKET else upper_bound_s(i - 1)
                hi = upper_bound_s(i)
                out.append(lo if math.isinf(hi) else lo + (hi - lo) * (rank - seen) / n)
                break
            seen += n
    return out


def cumulative_at_powers_of_two(buckets: Mapping[int, int]) -> list[tuple[float, int]]:
    """(upper bound, results at or below it) at every power of two from the smallest bucket's
    bound to 2^12 s, then (inf, all): a Prometheus histogram's `le` buckets (every other
    √2-wide bucket edge, exact since the edges coincide)."""
    out = []
    total = 0
    ordered = sorted(buckets.items())
    k = 0
    for i in range(MIN_BUCKET, OVERFLOW):
        while k < len(ordered) and ordered[k][0] <= i:
            total += ordered[k][1]
            k += 1
        if i % 2 == 0:
            out.append((upper_bound_s(i), total))
    out.append((math.inf, sum(buckets.values())))
    return out
