"""Which backend probably still caches a prompt's prefix: landmark block-hash chains, LRU-aged.

vLLM caches full 16-token blocks keyed by a chained hash (parent hash, block tokens), so a
prefix is cached on a backend only if every block before it is. MISA-T keeps, per backend, the
chained hashes of what it sent there — but only at *landmark* block counts 1, 2, 4, 8, … and
the prompt's last full block, so hashing a prompt costs O(len) once and matching it against
the whole fleet costs one dict lookup per landmark (O(log len)), plus the backends holding
each; the walk stops at the first landmark nobody holds.

Ageing follows vLLM's LRU free queue without seeing it: each backend counts the KV tokens
admitted to it (`churn`); an entry touched when the count was s is taken as evicted once
churn − s exceeds `horizon` (the backend's capacity: by then a full cache's worth of newer
blocks has gone through the free queue ahead of it).
"""

from __future__ import annotations

from dataclasses import dataclass

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


class PrefixIndex:
    """landmark hash -> {backend: its churn count when it last received that prefix}."""

    def __init__(self) -> None:
        self._caches: dict[str, _BackendCache] = {}
        self._oldest: dict[str, float] = {}  # churn − horizon: older stamps are evicted
        self._holders: dict[int, dict[str, float]] = {}
        self._purge_at = 8192  # prune aged-out entries once this many hashes are held

    def sync_backend(self, backend_id: str, capacity_tokens: int) -> None:
        cache = self._caches.get(backend_id)
        if cache is None:
            cache = self._caches[backend_id] = _BackendCache(float(capacity_tokens))
        else:
            cache.horizon = float(capacity_tokens)
        self._oldest[backend_id] = cache.churn - cache.horizon

    def drop_backend(self, backend_id: str) -> None:
        self._caches.pop(backend_id, None)
        self._oldest.pop(backend_id, None)
        for holders in self._holders.values():
            holders.pop(backend_id, None)

    def backends(self) -> list[str]:
        return list(self._caches)

    def matches(self, key: PrefixKey) -> dict[str, int]:
        """For every backend that probably still caches some of `key`: how many tokens."""
        out: dict[str, int] = {}
        holders, oldest = self._holders, self._oldest
        for h, tokens in zip(key.hashes, key.tokens):
            held = holders.get(h)
            if not held:
                break  # no backend has this landmark, so none has a longer one
            for b, stamp in held.items():
                if stamp > oldest.get(b, stamp):
                    out[b] = tokens
        return out

    def match(self, key: PrefixKey, backend_id: str) -> int:
        """Tokens of `key`'s prefix that `backend_id` probably still caches (landmark precision)."""
        return self.matches(key).get(backend_id, 0)

    def insert(self, key: PrefixKey, backend_id: str, new_tokens: float) -> None:
        """Record that `key` was sent to the backend, which will allocate `new_tokens` for it."""
        cache = self._caches[backend_id]
        cache.churn += max(0.0, new_tokens)
        now = cache.churn
        self._oldest[backend_id] = now - cache.horizon
        holders = self._holders
        for h in key.hashes:
            held = holders.get(h)
            if held is None:
                holders[h] = {backend_id: now}
            else:
                held[backend_id] = now
        if len(holders) > self._purge_at:
            self._purge()

    def _purge(self) -> None:
        kept: dict[int, dict[str, float]] = {}
        for h, held in self._holders.items():
            alive = {b: s for b, s in held.items() if s > self._oldest.get(b, s)}
            if alive:
                kept[h] = alive
        self._holders = kept
        self._purge_at = max(8192, 2 * len(kept))
