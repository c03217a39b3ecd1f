"""A test-only policy (the baselines live in broker/policies/, written elsewhere).

Headroom: take pending items workload by workload, oldest first, each to the healthy backend
with the most room left under α·C after this decision's earlier admissions; stop an item when
no backend has room for prompt + max_tokens. Importable by a broker subprocess as
`tests.broker.policies_for_tests:HeadroomPolicy`.
"""

from __future__ import annotations

from broker.policies.base import Admission, Decision, Policy, Snapshot, default_reservation


class HeadroomPolicy(Policy):
    name = "test_headroom"

    def __init__(self) -> None:
        self.seen_completions = 0
        self.recalled: list[str] = []  # session ids of the completions `recall` was handed

    def recall(self, history) -> None:
        self.recalled.extend(c.session_id for c in history)

    def decide(self, snapshot: Snapshot) -> Decision:
        self.seen_completions += len(snapshot.new_completions)
        room = {b.backend_id: int(b.alpha * b.capacity_tokens) - b.reserved_tokens
                for b in snapshot.backends if b.healthy}
        out = Decision()
        for workload in sorted(snapshot.pending):
            for item in snapshot.pending[workload]:
                if not room:
                    return out
                charge = default_reservation(item)
                best = max(room, key=lambda b: (room[b], b))
                if room[best] < charge:
                    break
                room[best] -= charge
                out.admissions.append(Admission(item.session_id, best, charge))
        return out


class OverbookingPolicy(HeadroomPolicy):
    """Ignores the ledger's limit (admits everything to one backend): the admit script must
    refuse what does not fit, which is what the concurrency test checks."""

    name = "test_overbooking"

    def decide(self, snapshot: Snapshot) -> Decision:
        healthy = [b.backend_id for b in snapshot.backends if b.healthy]
        out = Decision()
        if not healthy:
            return out
        for i, item in enumerate(x for items in snapshot.pending.values() for x in items):
            out.admissions.append(Admission(item.session_id, healthy[i % len(healthy)],
                                            default_reservation(item)))
        return out


class RechargingPolicy(HeadroomPolicy):
    """Admits as HeadroomPolicy and re-charges every resident session to `charge` tokens."""

    name = "test_recharging"

    def __init__(self, charge: int) -> None:
        super().__init__()
        self.charge = charge

    def decide(self, snapshot: Snapshot) -> Decision:
        out = super().decide(snapshot)
        for b in snapshot.backends:
            for s in b.sessions:
                if s.reserved_tokens != self.charge:
                    out.recharge[s.session_id] = self.charge
        return out
