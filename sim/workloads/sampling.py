"""Seeded samplers for the scenario distributions (numpy Generator, explicit seeds only)."""

from __future__ import annotations

import numpy as np

from sim.scenario import LogNormal, LogNormalMixture


def lognormal(rng: np.random.Generator, spec: LogNormal, size: int) -> np.ndarray:
    """`size` draws of LN(median, sigma), values above the cap set to the cap."""
    x = spec.median * np.exp(spec.sigma * rng.standard_normal(size))
    return np.minimum(x, spec.cap) if spec.cap is not None else x


def lognormal_mixture(rng: np.random.Generator, spec: LogNormalMixture, size: int) -> np.ndarray:
    weights = np.array([c.weight for c in spec.components], dtype=float)
    which = rng.choice(len(weights), size=size, p=weights / weights.sum())
    medians = np.array([c.median for c in spec.components])[which]
    sigmas = np.array([c.sigma for c in spec.components])[which]
    x = medians * np.exp(sigmas * rng.standard_normal(size))
    return np.minimum(x, spec.cap) if spec.cap is not None else x


def token_counts(values: np.ndarray) -> list[int]:
    """Round sampled lengths to whole tokens, at least 1."""
    return np.maximum(1, np.rint(values)).astype(np.int64).tolist()


def truncate(natural: list[int], cap: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Lengths the engine produces under a per-turn cap, and which turns hit it."""
    return tuple(min(n, cap) for n in natural), tuple(n > cap for n in natural)
