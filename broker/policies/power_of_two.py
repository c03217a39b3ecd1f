"""power_of_two: sample two distinct healthy backends, send the request to the less loaded one.

The rule of the vLLM Router's `power_of_two` policy: draw an index uniformly among the healthy
backends, draw a second until it differs from the first, and pick the first unless the second
has strictly fewer requests in flight (this call's earlier placements included). With a single
healthy backend it is chosen without drawing. The draws come from the policy's own
`random.Random(seed)`, so a seed fixes every choice. Every request is dispatched on arrival.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from broker.policies import register
from broker.policies.base import PendingItem
from broker.policies.router_base import RouterPolicy


@register
class PowerOfTwo(RouterPolicy):
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, item: PendingItem, backends: Sequence[str], load: Mapping[str, int]) -> str:
        if len(backends) == 1:
            return backends[0]
        first = self._rng.randrange(len(backends))
        second = self._rng.randrange(len(backends))
        while second == first:
            second = self._rng.randrange(len(backends))
        a, b = backends[first], backends[second]
        return a if load[a] <= load[b] else b
