"""Which engines a simulated fleet has, as `fleet.changes` adds and removes them (sim.fleet).

An engine's life, as a worker pod's under an autoscaler:
joining (its ledger entry refuses admissions; not in the policy's snapshot until its first
heartbeat reaches the broker) → visible (in the snapshot, admitted to) → leaving (out of the
snapshot, its sessions run on for the drain grace) → cut (the grace is over: its sessions are
being handed back) → gone (nothing of it is left in the ledger). Engines are never reused: a
fresh one gets a fresh backend id. Only bookkeeping here; what each step does to sessions is
FleetSim's.
"""

from __future__ import annotations

from collections.abc import Iterable


class Membership:
    def __init__(self, engines: Iterable[str]) -> None:
        self.order: dict[str, int] = {}  # every engine ever, by when it joined (its id's index)
        self.visible: list[str] = []  # in the policy's snapshot, in `order`
        self.joining: set[str] = set()  # joined; its first heartbeat has not been delivered yet
        self.leaving: set[str] = set()  # out of the snapshot; sessions may still be on it
        self.cut: set[str] = set()  # of `leaving`: the grace is over, everything is handed back
        self.gone: set[str] = set()  # left: no session, request or ledger entry of it remains
        self.present: dict[str, tuple[float, float]] = {}  # engine -> (joined, left; inf: not)
        for b in engines:
            self.join(b, 0.0)
            self.seen(b)

    def join(self, b: str, now: float) -> None:
        assert b not in self.order, f"engine {b} joined twice"
        self.order[b] = len(self.order)
        self.joining.add(b)
        self.present[b] = (now, float("inf"))

    def seen(self, b: str) -> bool:
        """A heartbeat of `b` reached the broker: True when that makes it visible (its first)."""
        if b not in self.joining:
            return False
        self.joining.discard(b)
        self.visible.append(b)
        self.visible.sort(key=self.order.__getitem__)
        return True

    def serving(self, b: str) -> bool:
        """Joined and not leaving: its worker beats and takes admissions once visible."""
        return b in self.order and not (b in self.leaving or b in self.gone)

    def victims(self, n: int) -> list[str]:
        """The `n` engines a scale-in removes: the most recently added still serving, as a
        StatefulSet removes its highest ordinals first."""
        serving = sorted((b for b in self.order if self.serving(b)), key=self.order.__getitem__)
        assert n < len(serving), f"removing {n} of {len(serving)} engines leaves none"
        return serving[len(serving) - n:][::-1]

    def leave(self, b: str) -> None:
        assert self.serving(b), f"engine {b} is not serving"
        self.joining.discard(b)
        if b in self.visible:
            self.visible.remove(b)
        self.leaving.add(b)

    def start_cut(self, b: str) -> bool:
        """The grace of leaving engine `b` is over: False when it is gone already."""
        if b not in self.leaving:
            return False
        self.cut.add(b)
        return True

    def left(self, b: str, now: float) -> None:
        assert b in self.leaving, f"engine {b} is not leaving"
        self.leaving.discard(b)
        self.cut.discard(b)
        self.gone.add(b)
        self.present[b] = (self.present[b][0], now)
