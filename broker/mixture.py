"""The workload mixture, as numbers: quota counts of a batch and how far a batch drifts from π.

Pure functions shared by the trainer client, the status API, the demo and the simulator's
trainer model, so that every figure of drift in the project means the same thing (docs/measurement.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def quotas(batch_size: int, mixture: Mapping[str, float]) -> dict[str, int]:
    """Split `batch_size` by shares with largest remainders, so the counts sum to batch_size.

    Ties in the remainder go to the workload whose name sorts first, for determinism.
    """
    raw = {w: batch_size * p for w, p in mixture.items()}
    out = {w: math.floor(v) for w, v in raw.items()}
    short = batch_size - sum(out.values())
    for w in sorted(raw, key=lambda w: (out[w] - raw[w], w))[:short]:
        out[w] += 1
    return out


def mixture_drift(consumed: Mapping[str, int], target: Mapping[str, float]) -> float:
    """½·Σ_w |consumed_w / B − π_w| with B = Σ consumed: 0 on target, 1 when disjoint."""
    batch = sum(consumed.values())
    if batch <= 0:
        raise ValueError("consumed: empty iteration")
    names = sorted(set(consumed) | set(target))  # fixed order: float sums must not depend on hash seeds
    return 0.5 * sum(abs(consumed.get(w, 0) / batch - target.get(w, 0.0)) for w in names)
