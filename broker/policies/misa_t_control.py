"""MISA-T's two feedback rules, as small pure units: α by AIMD, and workload KV shares.

`AimdParams.step` turns one backend's heartbeat into its next α (docs/misa-t.md): back off
multiplicatively on a new preemption, a growing engine waiting queue or KV usage above the high
watermark; otherwise, while usage is below target, the backend has been calm for `calm_s` (or
its engine has drained: usage below `recovered_kv` and nothing queued), work is pending and α
is what binds, move α toward the α at which the engine would sit at its
target usage. That α comes from closing the loop between what the ledger charges and what the
engine holds: ρ_b (`usage_ratio`), the KV the engine reports in use per token charged there,
tracked per heartbeat; reservations of α·C_b then mean about ρ_b·α·C_b in use, so the
ceiling is kv_target/ρ_b. Charges are expected *final* contexts, which sessions at different
points of their lives do not reach together (and parked agentic histories sit in vLLM's
evictable prefix cache, outside `kv_cache_usage_perc`), so ρ_b is well below 1 and α well
above it: no fixed cap binds before the engine's own signals do.

`shares` and `admissible` are the allocation of docs/misa-t.md: σ_w = π_w K_w / Σ_v π_v K_v of the
admitted capacity, a deficit counter on consumed-vs-target nudging σ, lending to whoever has
pending work while a share sits idle, and reclaiming only by not lending any more (a borrowed
reservation is never taken back: it goes back as the borrower finishes).

`CompletionPacer` is the optional mixture pacing of the `misa_t-paced` variant: in `fifo`
consumption the trainer's next batches are whatever finishes next, so a workload whose sessions
would finish faster than its share π_w allows admits nothing more while others run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker.policies.base import Telemetry


@dataclass(frozen=True, slots=True)
class AimdParams:
    # Charges are expected *final* contexts (misa_t.py), so α = 1 (the ledger's α of a new
    # backend, where the loop starts, except in a cold start: misa_t_alpha.py) means "the
    # expected peak of everything admitted fits".
    alpha_min: float = 0.6  # a preempting backend still admits once its ledger drains this far
    # Not a limit the loop aims at: a guard against a ratio measured on a backend whose few
    # sessions have barely started (ρ near 0 asks for an unbounded α). It does bind in cold
    # starts, where charges sit at the length caps; a guard of 8 was tried and not kept
    # (docs/results/misa-t.md §4: neutral on a held-out draw, more preemptions under contention).
    alpha_max: float = 4.0
    usage_ratio_gain: float = 0.3  # EWMA gain of ρ_b per heartbeat (~3 s memory at 1 s)
    min_charged: float = 0.05  # ρ_b is measured only while this fraction of C_b is charged
    approach: float = 0.5  # per calm heartbeat α closes this fraction of its gap to the ceiling
    backoff_preempt: float = 0.9  # the engine recomputed someone: the ledger let too much in
    backoff_waiting: float = 0.95  # the engine queue grows: admitted work does not fit
    backoff_high: float = 0.97  # usage above the watermark: the next growth step may preempt
    kv_high: float = 0.99  # vLLM preempts at 100%: keep one decode burst of slack
    kv_target: float = 0.97  # the usage the ceiling aims at; α grows only below it ...
    calm_s: float = 3.0  # ... and when no preemption or back-off happened for this long,
    # or when the engine has drained: usage below this with no request queued, the congestion
    # it backed off from is over (the cohort that filled it finished) and waiting out calm_s
    # leaves its KV idle while sessions wait
    recovered_kv: float = 0.75
    waiting_tolerance: int = 4  # queued requests tolerated (arrivals wait a step for prefill)
    # α binds when reservations reach this fraction of α·C_b, or when the smallest session
    # waiting to start would not fit under α·C_b (sessions that are large against C_b: three
    # of 8K on an engine of 31K leave 20% free and still admit nothing)
    binding: float = 0.9

    def usage_ratio(self, old: float | None, now: Telemetry, reserved: float,
                    capacity: float) -> float | None:
        """ρ_b after heartbeat `now`: the EWMA of (KV in use) / (KV charged); unchanged while
        too little is charged for the ratio to mean anything."""
        if reserved < self.min_charged * capacity:
            return old
        ratio = now.kv_usage * capacity / reserved
        return ratio if old is None else old + self.usage_ratio_gain * (ratio - old)

    def ceiling(self, ratio: float | None) -> float | None:
        """The α at which the engine would sit at kv_target; None before any measurement."""
        if ratio is None or ratio <= 0:
            return None
        return min(self.alpha_max, self.kv_target / ratio)

    def step(
        self,
        alpha: float,
        now: Telemetry,
        before: Telemetry | None,
        *,
        next_charge: float | None,
        reserved: float,
        capacity: float,
        ratio: float | None,
        calm_for: float = float("inf"),
    ) -> float:
        """The α after heartbeat `now` (`before` is the previous one from this backend; `ratio`
        is ρ_b including `now`); `next_charge` is the smallest charge of a session waiting to
        start (None: none waits); `calm_for` is how long ago this backend last preempted or
        backed off (growth waits `calm_s` after that unless the engine has drained)."""
        backoff = self.backoff(now, before)
        ceiling = self.ceiling(ratio)
        if backoff is not None:
            # Anti-windup (docs/misa-t.md): never below backoff·R_b/C_b, the reservations
            # the engine held when it signalled, unless that is α·backoff. Where R_b already
            # exceeds α·C_b admission is closed here and the congestion lasts while the engine
            # works through what it took: shrinking α on every beat of it wound α down to
            # alpha_min, and the engine idled once it cleared.
            alpha = max(alpha * backoff, min(alpha, backoff * reserved / capacity))
        elif (
            ceiling is not None
            and ceiling > alpha
            and now.kv_usage < self.kv_target
            and (calm_for >= self.calm_s or self.drained(now))
            and next_charge is not None
            and self.binds(alpha, reserved, capacity, next_charge)
        ):
            alpha += self.approach * (ceiling - alpha)
        return min(self.alpha_max, max(self.alpha_min, alpha))

    def drained(self, now: Telemetry) -> bool:
        """Whether the engine has room and nothing queued, however recently α backed off."""
        return now.kv_usage < self.recovered_kv and now.waiting == 0

    def binds(self, alpha: float, reserved: float, capacity: float, next_charge: float) -> bool:
        """Whether α is what stops admissions here: reservations are near α·C_b, or the
        smallest waiting session no longer fits under it."""
        limit = alpha * capacity
        return reserved >= self.binding * limit or reserved + next_charge > limit

    def backoff(self, now: Telemetry, before: Telemetry | None) -> float | None:
        """The factor heartbeat `now` shrinks α by, first rule that applies: a new preemption,
        a growing engine queue, usage above the high watermark; None when none does."""
        if before is not None and now.preemptions_total > before.preemptions_total:
            return self.backoff_preempt
        if now.waiting > self.waiting_tolerance and (before is None or now.waiting > before.waiting):
            return self.backoff_waiting
        if now.kv_usage > self.kv_high:
            return self.backoff_high
        return None

    def backed_off(self, now: Telemetry, before: Telemetry | None) -> bool:
        """Whether `step` would shrink α on this heartbeat (starts the calm clock again)."""
        return self.backoff(now, before) is not None


def shares(
    target: Mapping[str, float],
    kv_seconds: Mapping[str, float],
    consumed: Mapping[str, int],
    deficit_gain: float,
) -> dict[str, float]:
    """σ_w ∝ π_w·K_w·(1 + gain·deficit_w), normalised; deficit_w = (π_w·N − consumed_w)/(π_w·N).

    A workload consumed less than its target (deficit > 0) gets a larger share, one consumed
    more a smaller one; the factor is clamped to [0.5, 2] so a transient cannot starve anyone.
    """
    total = sum(consumed.values())
    raw: dict[str, float] = {}
    for w, pi in target.items():
        if pi <= 0:
            continue
        factor = 1.0
        if total > 0 and deficit_gain > 0:
            expected = pi * total
            factor = 1.0 + deficit_gain * (expected - consumed.get(w, 0)) / expected
            factor = min(2.0, max(0.5, factor))
        raw[w] = pi * max(kv_seconds.get(w, 0.0), 1e-9) * factor
    norm = sum(raw.values())
    return {w: v / norm for w, v in raw.items()} if norm > 0 else {}


def admissible(
    waiting: Iterable[str], used: Mapping[str, float], quota: Mapping[str, float]
) -> list[str]:
    """The workloads of `waiting` that may take more KV now, in one pass.

    Within its quota a workload always may. Beyond it, it borrows, and only while no *other*
    waiting workload is below its own quota: once one is, lending stops and the borrowed
    capacity returns to it as the borrower's sessions finish. So: those below their quota, or,
    when none is, all of them."""
    waiting = list(waiting)
    below = [w for w in waiting if used.get(w, 0.0) < quota.get(w, 0.0)]
    return below or waiting


@dataclass(slots=True)
class CompletionPacer:
    """Keeps each workload's share of the completion stream near π_w (mixture pacing).

    By Little's law a workload with n_w sessions in flight and a mean admission-to-finish time
    of d_w finishes n_w/d_w sessions per second; in `fifo` consumption those rates' shares are
    the mix of the trainer's next batches. A paced workload is *ahead* while its rate exceeds
    (1 + tolerance)·π_w of the total and other workloads have sessions in flight; an ahead
    workload admits nothing more in this call. The test comes before each admission, so the
    workload furthest behind can always admit (no stall), and one that runs alone is never
    ahead (no idle fleet). A paced workload without a share keeps at most one placement (a
    session or a GRPO group) in flight while others run.

    Scope `fast` paces only workloads whose sessions finish sooner than the mixture's mean
    session (d_w < Σ π_v·d_v): their admissions land in the next batches, and holding one back
    costs seconds of its own work. Holding back a slow workload idles its KV for minutes and
    shapes completions too far ahead to steer the next batches. Scope `all` paces every
    workload (docs/results/misa-t.md §5, revision 6, and its git history measure both).
    """

    target: Mapping[str, float]  # π_w
    tolerance: float
    duration_s: Mapping[str, float]  # d_w, > 0
    paced: frozenset[str]  # the workloads this pacer may hold back
    rate: dict[str, float] = field(default_factory=dict)  # n_w / d_w, admissions included

    @classmethod
    def start(
        cls,
        target: Mapping[str, float],
        tolerance: float,
        duration_s: Mapping[str, float],
        in_flight: Mapping[str, int],
        scope: str,
    ) -> CompletionPacer:
        if scope not in ("all", "fast"):
            raise ValueError(f"pace_scope: {scope!r} is not 'all' or 'fast'")
        paced = frozenset(duration_s)
        if scope == "fast":
            weight = sum(target.get(w, 0.0) for w in duration_s)
            mean = sum(target.get(w, 0.0) * d for w, d in duration_s.items()) / weight if weight else 0.0
            paced = frozenset(w for w, d in duration_s.items() if d < mean)
        rate = {w: n / duration_s[w] for w, n in in_flight.items() if w in duration_s}
        return cls(target, tolerance, duration_s, paced, rate)

    def ahead(self, workload: str) -> bool:
        if workload not in self.paced:
            return False
        mine = self.rate.get(workload, 0.0)
        total = sum(self.rate.values())
        return total > mine and mine > (1.0 + self.tolerance) * self.target.get(workload, 0.0) * total

    def admitted(self, workload: str, sessions: int) -> None:
        if workload in self.duration_s:
            self.rate[workload] = self.rate.get(workload, 0.0) + sessions / self.duration_s[workload]
