"""Which backend probably still caches a prompt's prefix: landmark block-hash chains, LRU-aged.

vLLM caches full 16-token blocks keyed by a chained hash (parent hash, block tokens), so a
prefix is cached on a backend only if every block before it is. MISA-T keeps, per backend, the
chained hashes of what it sent there — but only at *landmark* block counts 1, 2, 4, 8, … and
the prompt's last full block, so hashing a prompt costs O(len) once and matching it against a
backend costs O(log landmarks) dict lookups (binary search: a landmark is remembered only if
every shorter landmark of the same prompt is, because each insert touches them all at once).

Ageing follows vLLM's LRU free queue without seeing it: each backend counts the KV tokens
admitted to it (`churn`); an entry touched when the count was s is taken as evicted once
churn − s exceeds `horizon` (the backend's capacity: by then a full cache's worth of newer
blocks has gone through the free queue ahead of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.policies.base import BLOCK_SIZE

_ROOT = 0x5F3759DF


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A prompt's landmark chain: `hashes[i]` covers the first `tokens[i]` tokens."""

    hashes: tuple[int, ...]
    tokens: tuple[int, ...]


def prefix_key(prefix: tuple[int, ...]) -> PrefixKey:
    full_blocks = len(prefix) // BLOCK_SIZE
    marks: list[int] = []
    k = 1
    while k < full_blocks:
        marks.append(k)
        k *= 2
    if full_blocks:
        marks.append(full_blocks)
    hashes: list[int] = []
    h, start = _ROOT, 0
    for m in marks:
        end = m * BLOCK_SIZE
        h = hash((h, prefix[start:end]))
        hashes.append(h)
        start = end
    return PrefixKey(tuple(hashes), tuple(m * BLOCK_SIZE for m in marks))


@dataclass(slots=True)
class _BackendCache:
    horizon: float  # tokens of churn after which an untouched entry is taken as evicted
    churn: float = 0.0  # KV tokens admitted here so far
    stamps: dict[int, float] = field(default_factory=dict)  # landmark hash -> churn at last touch
    purge_at: int = 4096  # prune aged-out stamps once the dict grows past this (amortised O(1))


class PrefixIndex:
    def __init__(self) -> None:
        self._caches: dict[str, _BackendCache] = {}

    def sync_backend(self, backend_id: str, capacity_tokens: int) -> None:
        cache = self._caches.get(backend_id)
        if cache is None:
            self._caches[backend_id] = _BackendCache(float(capacity_tokens))
        else:
            cache.horizon = float(capacity_tokens)

    def drop_backend(self, backend_id: str) -> None:
        self._caches.pop(backend_id, None)

    def backends(self) -> list[str]:
        return list(self._caches)

    def match(self, key: PrefixKey, backend_id: str) -> int:
        """Tokens of `key`'s prefix that `backend_id` probably still caches (landmark precision)."""
        cache = self._caches.get(backend_id)
        if cache is None or not key.hashes:
            return 0
        stamps, oldest = cache.stamps, cache.churn - cache.horizon
        lo, hi = 0, len(key.hashes)  # landmarks [0, lo) are cached; [hi, …) are not
        while lo < hi:
            mid = (lo + hi) // 2
            s = stamps.get(key.hashes[mid])
            if s is not None and s > oldest:
                lo = mid + 1
            else:
                hi = mid
        return key.tokens[lo - 1] if lo else 0

    def insert(self, key: PrefixKey, backend_id: str, new_tokens: float) -> None:
        """Record that `key` was sent to the backend, which will allocate `new_tokens` for it."""
        cache = self._caches[backend_id]
        cache.churn += new_tokens
        now = cache.churn
        stamps = cache.stamps
        for h in key.hashes:
            stamps[h] = now
        if len(stamps) > cache.purge_at:
            oldest = now - cache.horizon
            cache.stamps = {h: s for h, s in stamps.items() if s > oldest}
            cache.purge_at = max(4096, 2 * len(cache.stamps))
