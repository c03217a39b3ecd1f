"""What the router baselines share: place every pending request at once, one pick rule each.

An HTTP router (the vLLM Router and its simpler policies) does not admit: it forwards each
request the moment it arrives and lets the engine queue it. A `RouterPolicy` therefore places
every pending item, oldest first across workloads, on a healthy backend, with no capacity
check, charging `default_reservation`. It sends a request only to an engine serving its model
(and LoRA, for an adapter), as a router that knows each worker's models does; adapter slots
are the engine's to queue for. Its load signal is the router's own: requests it has
dispatched to a backend and that have not finished, i.e. `BackendView.in_flight` plus what it
placed earlier in the same `decide()` call (the router increments a worker's load on dispatch).
Subclasses supply only `choose`, the per-request pick.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

from broker.policies.base import (
    Admission,
    Decision,
    PendingItem,
    Policy,
    Snapshot,
    default_reservation,
    serves,
)


def arrival_order(pending: Mapping[str, tuple[PendingItem, ...]]) -> Iterator[PendingItem]:
    """All pending items, oldest first across workloads.

    Ties on `enqueued_at` (a GRPO group arrives at one instant) keep each workload's own order,
    and workloads tie by name, so the order never depends on the mapping's iteration order.
    """
    keyed = [
        (item.enqueued_at, workload, position, item)
        for workload, items in pending.items()
        for position, item in enumerate(items)
    ]
    keyed.sort(key=lambda entry: entry[:3])
    return (entry[3] for entry in keyed)


def least_loaded(backends: Sequence[str], load: Mapping[str, int]) -> str:
    """The backend with the fewest in-flight requests; ties go to the earliest in `backends`."""
    return min(backends, key=load.__getitem__)


class RouterPolicy(Policy):
    dispatch_on_arrival: ClassVar[bool] = True
    reads_progress: ClassVar[bool] = False  # a router sees its in-flight counts, not heartbeats

    @abstractmethod
    def choose(self, item: PendingItem, backends: Sequence[str], load: Mapping[str, int]) -> str:
        """Pick one of `backends` (healthy, in snapshot order, never empty) for `item`.

        `load[b]` is b's in-flight request count including this call's earlier placements.
        """

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = Decision()
        load = {b.backend_id: b.in_flight for b in snapshot.backends if b.healthy}
        if not load:
            return decision
        backends = list(load)
        views = {b.backend_id: b for b in snapshot.backends if b.healthy}
        for item in arrival_order(snapshot.pending):
            able = backends
            if item.model is not None or item.adapter is not None:
                able = [b for b in backends if serves(views[b], item)]
                if not able:
                    continue  # no live engine serves its model: it waits
            backend_id = self.choose(item, able, load)
            assert backend_id in load, f"{self.name} chose {backend_id!r}, not a healthy backend"
            load[backend_id] += 1
            decision.admissions.append(
                Admission(item.session_id, backend_id, default_reservation(item))
            )
        return decision
