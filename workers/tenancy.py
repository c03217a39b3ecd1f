"""The namespaces one worker process serves on its one engine, and each one's part of it.

`rollout-broker worker --namespace 'jobA=0.6,jobB=0.4'` runs one `Worker` per namespace in one
process, over one engine: each registers, beats, pulls and follows weight orders in its own
namespace. This object is what they share: the guaranteed shares, what each namespace's
sessions hold on the engine now, and whether each one's broker has work waiting for it. Every
beat asks it for the beating namespace's part of the engine (`broker.shares.part_for`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from broker.heartbeat import SharedPart
from broker.shares import EnginePart, Tenant, is_waiting, part_for

# What a namespace's sessions hold on the engine now: (context tokens, engine names of the
# LoRA adapters they use). Called from heartbeat threads: it must only read.
Holdings = Callable[[], tuple[int, frozenset[str]]]


@dataclass(frozen=True, slots=True)
class Stake:
    """What a namespace's ledger says of the engine (read by its worker every beat)."""

    reserved_tokens: int = 0
    alpha: float = 1.0
    waiting_at: float | None = None  # when its broker last said it has work waiting here


class EngineTenancy:
    def __init__(self, shares: Mapping[str, float]) -> None:
        if not shares:
            raise ValueError("namespace: a worker serves at least one namespace")
        self.shares = dict(shares)
        self._holdings: dict[str, Holdings] = {}
        self._stakes: dict[str, Stake] = {}

    @property
    def shared(self) -> bool:
        return len(self.shares) > 1

    def adapter_scope(self, namespace: str) -> str:
        """The prefix of `namespace`'s adapter names in the engine: none on an engine of one."""
        return f"{namespace}/" if self.shared else ""

    def join(self, namespace: str, holdings: Holdings) -> None:
        if namespace not in self.shares:
            raise ValueError(f"namespace: {namespace!r} is not one this worker serves")
        self._holdings[namespace] = holdings

    def read_stake(self, namespace: str, stake: Stake) -> None:
        """`namespace`'s ledger as its worker just read it."""
        self._stakes[namespace] = stake

    def part(self, namespace: str, capacity_tokens: int, kv_usage: float,
             now: float | None = None) -> EnginePart:
        now = time.time() if now is None else now
        tenants = []
        for ns, share in self.shares.items():
            kv, adapters = self._holdings[ns]() if ns in self._holdings else (0, frozenset())
            stake = self._stakes.get(ns, Stake())
            tenants.append(Tenant(ns, share, stake.reserved_tokens, stake.alpha,
                                  is_waiting(stake.waiting_at, now), kv, adapters))
        return part_for(namespace, tenants, capacity_tokens, kv_usage)

    def shared_part(self, namespace: str, part: EnginePart) -> SharedPart:
        """What `namespace`'s heartbeat says of its part."""
        return SharedPart(capacity_tokens=part.capacity_tokens, share=self.shares[namespace],
                          foreign_adapters=part.foreign_adapters, namespaces=len(self.shares))
