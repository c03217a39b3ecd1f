"""least_loaded: send each request to the healthy backend with the fewest requests in flight.

In flight means the backend's sessions with a request on the engine now (`BackendView.in_flight`)
plus the requests this policy placed there earlier in the same decide() call. Ties go to the
backend that comes first in the snapshot. Every pending request is dispatched on arrival.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.policies import register
from broker.policies.base import PendingItem
from broker.policies.router_base import RouterPolicy, least_loaded


@register
class LeastLoaded(RouterPolicy):
    name = "least_loaded"

    def choose(self, item: PendingItem, backends: Sequence[str], load: Mapping[str, int]) -> str:
        return least_loaded(backends, load)
