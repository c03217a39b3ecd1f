"""Jobs sharing engines: each namespace's part of a shared engine, from guaranteed shares.

A worker may serve several namespaces (RL jobs) on one engine (`rollout-broker worker
--namespace 'jobA=0.6,jobB=0.4'`). Each namespace has its own queues, broker, mixture,
staleness and policy versions; what they share is the engine's KV cache and its LoRA slots.
Every namespace is guaranteed its share of the engine's KV and may borrow what the others
leave idle.

Each heartbeat the worker sends a namespace carries that namespace's *part* of the engine
(`part_for`): the KV tokens it may plan against, and the adapter slots the other namespaces'
running sessions hold. Its broker plans against the part as if it were the whole engine, so
every policy and the ledger rule stay as they are. Per other namespace m, the part leaves out

    hold_m = max(reserved_m / α_m,  share_m · C  if m is waiting else 0)

from the engine's C. reserved_m / α_m is m's stake in engine tokens: m's admission keeps
reserved_m ≤ α_m · part_m, so the stakes of all namespaces sum to at most C (α_m, MISA-T's
over-subscription factor, is what m's own loop learned maps its reservations to the KV they
use). It moves the moment m admits, not as m's sessions grow. "Waiting" means m's broker has
sessions pending that this engine could run (it says so in its own ledger, `waiting_at`). The
worker reads both from m's ledger every beat. So:
- a namespace whose peers are idle may use the whole engine (it borrows their shares);
- once a peer waits, nobody grows into the peer's unused guarantee, and the peer's part grows
  back to its share as the borrowers' sessions finish. Nothing is preempted to give a share
  back: an RL session cut short costs its whole recompute, so the share returns at the pace
  sessions end (a session's length, see docs/fleet.md).

Everything here is pure: the worker feeds it what it tracks and reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # as broker/keys.py checks namespaces

# A namespace counts as waiting while its broker said so this recently (it says so about once
# a second while it has work this engine could run).
WAITING_FRESH_S = 3.0


def parse_tenants(text: str) -> dict[str, float]:
    """The namespaces a worker serves and their guaranteed shares, from `--namespace`:
    'job' (one namespace, the whole engine), 'jobA,jobB' (equal shares) or
    'jobA=0.6,jobB=0.4'. A namespace without a share gets an equal part of what the named
    shares leave. ValueError naming the field when a name or a share cannot work."""
    tenants: dict[str, float | None] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise ValueError(f"namespace: {text!r} has an empty entry; write 'jobA=0.6,jobB=0.4'")
        name, eq, share = part.partition("=")
        name = name.strip()
        if not _NAME_RE.match(name):
            raise ValueError(f"namespace: {name!r} must be 1-64 characters of letters, digits, "
                             "'_', '.' or '-'")
        if name in tenants:
            raise ValueError(f"namespace: {name!r} is named twice")
        if not eq:
            tenants[name] = None
            continue
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"namespace: the share of {name!r} ({share!r}) is not a "
                             "number") from None
        if not 0.0 < value <= 1.0:
            raise ValueError(f"namespace: the share of {name!r} ({value}) must be in (0, 1]: "
                             "the fraction of the engine guaranteed to it")
        tenants[name] = value
    named = sum(v for v in tenants.values() if v is not None)
    if named > 1.0 + 1e-9:
        raise ValueError(f"namespace: the shares sum to {named:g}; guaranteed shares of one "
                         "engine may sum to at most 1")
    unnamed = [n for n, v in tenants.items() if v is None]
    if unnamed:
        rest = (1.0 - named) / len(unnamed)
        if rest <= 1e-9:
            raise ValueError(f"namespace: the named shares sum to {named:g} and leave nothing "
                             f"for {', '.join(unnamed)}")
        tenants.update({n: rest for n in unnamed})
    return {n: float(v) for n, v in tenants.items()}


@dataclass(frozen=True, slots=True)
class Tenant:
    """One namespace on a shared engine, as its worker sees it now."""

    namespace: str
    share: float  # its guaranteed fraction of the engine's KV
    reserved_tokens: int  # its ledger's reservations on the engine
    alpha: float  # its ledger's α for the engine (reservations may reach α times its part)
    waiting: bool  # its broker has sessions pending that this engine could run
    kv_tokens: int = 0  # the context its sessions hold on the engine now (splits the KV in use)
    # The LoRA adapters its running sessions use, by their names in the engine (a shared
    # engine loads each namespace's adapters under names of their own: workers/adapters.py).
    adapters: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class EnginePart:
    """A namespace's part of a shared engine: what its broker plans against."""

    capacity_tokens: int  # the KV it may plan against now (at least 1: nothing fits at 1)
    # The engine's KV in use that is its own, as a fraction of that part: above 1 while it
    # holds more than its part (it borrowed, or its sessions grew past what it planned), so
    # that its broker's α loop sees by how much.
    kv_usage: float
    foreign_adapters: int  # adapter slots the other namespaces' running sessions hold


def hold(tenant: Tenant, capacity_tokens: int) -> int:
    """The KV a namespace keeps from the others: its stake, or its guarantee while it has
    work waiting for this engine."""
    guaranteed = int(tenant.share * capacity_tokens) if tenant.waiting else 0
    stake = math.ceil(tenant.reserved_tokens / tenant.alpha) if tenant.alpha > 0 else 0
    return max(stake, guaranteed)


def part_for(namespace: str, tenants: Sequence[Tenant], capacity_tokens: int,
             kv_usage: float) -> EnginePart:
    """`namespace`'s part of an engine of `capacity_tokens` whose KV is `kv_usage` full, shared
    with `tenants` (which include it). The engine's KV in use is split between the
    namespaces in proportion to the context their sessions hold (prefix sharing makes the
    engine's own count smaller than the sum)."""
    own = next((t for t in tenants if t.namespace == namespace), None)
    if own is None:
        raise ValueError(f"namespace: {namespace!r} is not one of this engine's namespaces")
    others = [t for t in tenants if t.namespace != namespace]
    capacity = max(1, capacity_tokens - sum(hold(t, capacity_tokens) for t in others))
    total_kv = sum(t.kv_tokens for t in tenants)
    used = kv_usage * capacity_tokens * (own.kv_tokens / total_kv) if total_kv else 0.0
    foreign = frozenset().union(*(t.adapters for t in others))
    return EnginePart(capacity_tokens=capacity, kv_usage=used / capacity,
                      foreign_adapters=len(foreign))


def is_waiting(waiting_at: float | None, now: float) -> bool:
    """Whether a broker's `waiting_at` (unix seconds; None: never said) still stands."""
    return waiting_at is not None and now - waiting_at <= WAITING_FRESH_S


def shares_of(tenants: Mapping[str, float]) -> str:
    """'jobA=0.6,jobB=0.4': the `--namespace` text of `tenants` (for logs and errors)."""
    return ",".join(f"{n}={s:g}" for n, s in tenants.items())
