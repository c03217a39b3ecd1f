"""cache_aware: the vLLM Router 0.1.17 `cache_aware` policy, on token prefixes.

For each request, in arrival order, over the healthy backends:

1. Load is each backend's requests in flight (this call's earlier placements included: the
   router counts a request from dispatch to completion). The fleet is *imbalanced* when
   max − min > `balance_abs_threshold` and max > `balance_rel_threshold` × min.
2. Every backend gets a match rate: the longest prefix of the request that the router has
   already sent to that backend (per the shared prefix tree), divided by the request's length.
3. If the fleet is balanced and the best rate exceeds `cache_threshold`, the request goes to
   the least loaded of the backends with the best rate; otherwise (imbalanced, or no rate above
   the threshold) to the least loaded backend. Ties go to the backend listed first.
4. The request's prefix is inserted into the tree under the chosen backend, whichever branch
   chose it. A request with an empty prefix goes to the least loaded backend and is not
   inserted (the router's "missing tokens" case).

The tree forgets by LRU, as the router's background thread does: every `eviction_interval_s`
of snapshot time, each backend holding more than `max_tree_size` tokens loses its least
recently routed leaves until it fits. Backends that leave the snapshot are removed from it.

This follows `select_worker_with_inputs` → `prepare_selection` / `select_prepared` in
`src/policies/cache_aware.rs` of vllm-router 0.1.17 (the path its HTTP router takes for
cache_aware, `src/routers/http/router.rs`), with the tree of `src/tree.rs` (see prefix_tree.py).
The router keys a request by its token ids, 8 hex characters per token, and counts matches in
whole tokens; `PendingItem.prefix` is that token sequence, so the tree works on it directly and
sizes are in tokens: the router's default budget of 2**25 characters is 2**22 tokens.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Mapping, Sequence

from broker.policies import register
from broker.policies.base import Decision, PendingItem, Snapshot
from broker.policies.prefix_tree import PrefixTree
from broker.policies.router_base import RouterPolicy, least_loaded

ROUTER_CHARS_PER_TOKEN = 8  # the router encodes each token id as 8 hex characters
DEFAULT_MAX_TREE_SIZE = (1 << 25) // ROUTER_CHARS_PER_TOKEN  # router default, in tokens
DEFAULT_EVICTION_INTERVAL_S = 120.0  # router CLI / Python launcher default


def _f32(x: float) -> float:
    """x rounded to single precision: the router keeps both thresholds as f32."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@register
class CacheAware(RouterPolicy):
    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = DEFAULT_MAX_TREE_SIZE,
        eviction_interval_s: float = DEFAULT_EVICTION_INTERVAL_S,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(
                f"cache_aware: cache_threshold must be in [0, 1], got {cache_threshold}"
            )
        if balance_abs_threshold < 0:
            raise ValueError(
                f"cache_aware: balance_abs_threshold must be >= 0, got {balance_abs_threshold}"
            )
        if balance_rel_threshold < 0:
            raise ValueError(
                f"cache_aware: balance_rel_threshold must be >= 0, got {balance_rel_threshold}"
            )
        if max_tree_size < 0:
            raise ValueError(f"cache_aware: max_tree_size must be >= 0, got {max_tree_size}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s  # <= 0: never evict, as the router
        self._threshold32 = _f32(cache_threshold)
        self._rel32 = _f32(balance_rel_threshold)
        self.tree = PrefixTree()
        self._next_eviction: float | None = None  # snapshot time of the next eviction pass

    def decide(self, snapshot: Snapshot) -> Decision:
        present = {b.backend_id for b in snapshot.backends}
        for tenant in self.tree.tenants():
            if tenant not in present:
                self.tree.remove_tenant(tenant)
        self._evict_if_due(snapshot.now)
        return super().decide(snapshot)

    def _evict_if_due(self, now: float) -> None:
        if self.eviction_interval_s <= 0:
            return
        if self._next_eviction is None:
            # The router's eviction thread first wakes one interval after it starts.
            self._next_eviction = now + self.eviction_interval_s
            return
        if now >= self._next_eviction:
            self.tree.evict(self.max_tree_size)
            missed = math.floor((now - self._next_eviction) / self.eviction_interval_s)
            self._next_eviction += (missed + 1) * self.eviction_interval_s

    def is_imbalanced(self, min_load: int, max_load: int) -> bool:
        """The router's test, with its f32 product: f32(min) × f32(rel) rounded to f32."""
        return max_load - min_load > self.balance_abs_threshold and max_load > _f32(
            min_load * self._rel32
        )

    def choose(self, item: PendingItem, backends: Sequence[str], load: Mapping[str, int]) -> str:
        key = item.prefix
        if not key:
            return least_loaded(backends, load)
        loads = [load[b] for b in backends]
        imbalanced = self.is_imbalanced(min(loads), max(loads))
        matched = self.tree.match_lengths(key)
        rates = [matched.get(b, 0) / len(key) for b in backends]
        best = max(rates)
        if not imbalanced and best > self._threshold32:
            candidates = [b for b, rate in zip(backends, rates) if rate == best]
        else:
            candidates = list(backends)
        chosen = least_loaded(candidates, load)
        self.tree.insert(key, chosen)
        return chosen


def cache_aware_grid() -> list[dict[str, float | int]]:
    """The parameter sets the bench tries for `cache_aware_swept` (the paper's sweep-tuned
    baseline): the router default and values on both sides of each of its three thresholds."""
    return [
        {
            "cache_threshold": threshold,
            "balance_abs_threshold": abs_threshold,
            "balance_rel_threshold": rel_threshold,
        }
        for threshold, abs_threshold, rel_threshold in itertools.product(
            (0.1, 0.3, 0.5, 0.7), (16, 64, 256), (1.2, 1.5, 2.0)
        )
    ]
