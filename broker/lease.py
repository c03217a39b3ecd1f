"""The broker lease: at most one active broker per namespace.

`SET lease <token> NX PX <period>` acquires it; `lua/lease_renew.lua` extends it only for the
holder (compare-and-set). A broker renews every period/3 (between rounds; its wait for work
ends when the renewal is due), so a live broker keeps it through two missed renewals; a killed
one loses it after at most one period, and a standby that tries every period/3 takes over
within 4/3 periods. The admit, reclaim and recharge scripts check the token, so a broker that
stalled past its lease can no longer change anything (fencing).
"""

from __future__ import annotations

import time
import uuid

import redis

from broker.keys import Keys
from broker.scripts import Scripts


class Lease:
    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts, period_s: float,
                 holder: str = "") -> None:
        """`holder` ("<policy>@<consumer>") leads the token, so that readers of the lease key
        (the status API) can say who is active with which policy; the token stays unique."""
        if period_s <= 0:
            raise ValueError(f"lease_period: {period_s} must be positive")
        self._client = client
        self._keys = keys
        self._scripts = scripts
        self.period_ms = max(1, int(period_s * 1000))
        self.token = f"{holder}/{uuid.uuid4().hex}" if holder else uuid.uuid4().hex
        self._renewed_at = 0.0  # monotonic time of the last successful acquire/renew
        self.held = False

    @property
    def renew_interval_s(self) -> float:
        return self.period_ms / 3000.0

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it, or keep it if it is still ours (after a Redis
        outage shorter than the period, say)."""
        self.held = bool(self._scripts.lease_renew(keys=[self._keys.lease],
                                                   args=[self.token, self.period_ms])
                         or self._client.set(self._keys.lease, self.token, nx=True,
                                             px=self.period_ms))
        if self.held:
            self._renewed_at = time.monotonic()
        return self.held

    def renew(self) -> bool:
        ok = self._scripts.lease_renew(keys=[self._keys.lease], args=[self.token, self.period_ms])
        self.held = bool(ok)
        if self.held:
            self._renewed_at = time.monotonic()
        return self.held

    def renew_due(self) -> bool:
        return self.renew_in_s() <= 0.0

    def renew_in_s(self) -> float:
        """Seconds until the next renewal is due (0 or less: due now). A broker waiting for
        work waits no longer than this, so that a wait never delays a renewal."""
        return self._renewed_at + self.renew_interval_s - time.monotonic()

    def release(self) -> None:
        if self.held:
            self._scripts.lease_release(keys=[self._keys.lease], args=[self.token])
            self.held = False
