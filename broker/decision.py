"""Applying a policy's `Decision` to the KV ledger: one order and one refusal rule for the live
broker and the fleet simulator alike.

Order: first the new α of each backend, then the recharges, then the admissions, each against
the ledger as the steps before it left it (a recharge that shrinks a reservation makes room for
an admission in the same decision; a raised α does too).

Refusal rule, the one the Lua scripts enforce (`lua/admit.lua`, `lua/recharge.lua`): with
enforcement on (admission policies), a backend's reservations may not pass floor(α·C). An
admission that would pass it is refused (`no_capacity`), as is a recharge that grows a
reservation past it; a recharge that shrinks one always applies. Router baselines, which
dispatch on arrival and let the engine queue, are charged but never refused (enforcement off).
An admission to an unknown or unhealthy backend, or with a charge that is not a whole number of
tokens ≥ 0, is refused whatever the enforcement.

`apply_decision` is pure: the simulator keeps its ledger with it; the broker plans with it
against the ledger it has just read and sends what it accepts, in this order, to the scripts,
which apply the same rule atomically against the ledger as it is by then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from broker.policies.base import Admission, Decision


@dataclass(slots=True)
class LedgerEntry:
    """One backend's ledger as the rule needs it; change it through its methods, which keep
    `reserved_tokens` the sum of the per-session reservations."""

    capacity_tokens: int
    alpha: float = 1.0
    sessions: dict[str, int] = field(default_factory=dict)  # session_id -> reserved tokens
    healthy: bool = True
    reserved_tokens: int = -1  # computed from `sessions` when not given

    def __post_init__(self) -> None:
        if self.reserved_tokens < 0:
            self.reserved_tokens = sum(self.sessions.values())

    @property
    def limit_tokens(self) -> int:
        return math.floor(self.alpha * self.capacity_tokens)

    def charge(self, session_id: str, tokens: int) -> None:
        self.reserved_tokens += tokens - self.sessions.get(session_id, 0)
        self.sessions[session_id] = tokens

    def release(self, session_id: str) -> None:
        self.reserved_tokens -= self.sessions.pop(session_id, 0)


@dataclass(slots=True)
class Applied:
    """What the rule accepted, in the order it applies, and what it refused with why."""

    alpha: dict[str, float] = field(default_factory=dict)
    recharge: dict[str, tuple[str, int]] = field(default_factory=dict)  # sid -> (backend, tokens)
    admissions: list[Admission] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (session_id, reason)


def apply_decision(decision: Decision, ledgers: Mapping[str, LedgerEntry], enforce: bool
                   ) -> Applied:
    """Apply `decision` to `ledgers` in place (α, recharges, admissions); returns what held."""
    out = Applied()
    for b, alpha in decision.alpha.items():
        if b in ledgers and alpha > 0:
            ledgers[b].alpha = float(alpha)
            out.alpha[b] = float(alpha)
    where = {sid: b for b, led in ledgers.items() for sid in led.sessions}
    for sid, tokens in decision.recharge.items():
        b = where.get(sid)
        if b is None:
            out.refused.append((sid, "stale"))
            continue
        led = ledgers[b]
        old = led.sessions[sid]
        if tokens < 0 or tokens != int(tokens):
            out.refused.append((sid, "bad_charge"))
        elif enforce and tokens > old and led.reserved_tokens - old + tokens > led.limit_tokens:
            out.refused.append((sid, "no_capacity"))
        else:
            led.charge(sid, int(tokens))
            out.recharge[sid] = (b, int(tokens))
    for adm in decision.admissions:
        led = ledgers.get(adm.backend_id)
        charge = adm.reserved_tokens
        if led is None:
            reason = "no_backend"
        elif not led.healthy:
            reason = "unhealthy"
        elif charge < 0 or charge != int(charge):
            reason = "bad_charge"
        elif enforce and led.reserved_tokens + charge > led.limit_tokens:
            reason = "no_capacity"
        else:
            led.charge(adm.session_id, int(charge))
            out.admissions.append(adm)
            continue
        out.refused.append((adm.session_id, reason))
    return out


def touched_backends(
    decision: Decision, backend_of: Callable[[str], str | None]
) -> tuple[set[str], set[str]]:
    """The backends whose ledger entries `decision` can touch, so that a caller hands
    `apply_decision` only those, not the whole fleet: those of its α changes, of its admissions,
    and the one each recharged session is charged on (a session is charged on one backend at
    most), by `backend_of` (None: not known). Returns (backends, recharged sessions whose
    backend is not known)."""
    touched = set(decision.alpha)
    touched.update(adm.backend_id for adm in decision.admissions)
    unknown = set()
    for sid in decision.recharge:
        b = backend_of(sid)
        if b is not None:
            touched.add(b)
        else:
            unknown.add(sid)
    return touched, unknown
