"""round_robin: send each request to the next healthy backend in turn.

The rule of the vLLM Router's `round_robin` policy: a counter that survives between calls
counts every request routed; request k goes to healthy backend number k mod (number of healthy
backends), in snapshot order. Unhealthy backends are skipped by leaving them out of that list.
Load, sessions and prefixes are ignored; every pending request is dispatched on arrival.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.policies import register
from broker.policies.base import PendingItem
from broker.policies.router_base import RouterPolicy


@register
class RoundRobin(RouterPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._routed = 0  # requests routed so far, over all decide() calls

    def choose(self, item: PendingItem, backends: Sequence[str], load: Mapping[str, int]) -> str:
        backend_id = backends[self._routed % len(backends)]
        self._routed += 1
        return backend_id
