"""misa_t: admission with residency-time-aware KV accounting, workload KV shares and AIMD α.

Each `decide(snapshot)`:

1. Learn: completions feed the per-workload predictors (misa_t_predictors.py).
2. Account (residency): on each fresh heartbeat of a backend, re-charge its sessions. A
   single-turn session that has produced x tokens is charged prompt + the q-quantile of the
   lengths seen above x; a turn of a multi-turn session its context plus the same tail for the
   turn's output; a session parked on a tool keeps its history charged only while holding it
   is cheaper than re-prefilling it (expected remaining wait × history KV·s against the
   engine time a re-prefill costs, priced at the KV resident there), otherwise its charge is
   released. Changed charges go back in `Decision.recharge`.
3. Adapt α_b on that heartbeat (misa_t_control.AimdParams.step): back off on the engine's
   signals (a preemption, a growing queue, usage above the watermark), otherwise move toward
   the α at which the KV the engine reports in use would reach its target, given the measured
   ratio of used to charged KV on that backend (the loop between the ledger and the engine).
   Where the backend's residents are younger than the sessions that finished were over their
   residency (a cohort admitted together holds its prompts and is charged its expected ends),
   that ratio is scaled up by how much more they will hold: ∫KV dt / ∫charge dt of finished
   sessions against the residents' context per charged token now.
   Once every workload of the mixture has been seen and none is multi-turn, admission is open
   instead: α_b is `open_alpha` (the trainer's in-flight bound binds first) and the engine's
   own queue takes what does not fit, as behind a router. Without sessions parked between
   turns an overfull engine evicts nothing a later turn needs, and vLLM preempts the request
   it scheduled last, whose recompute mostly hits the prefix cache; held in the broker, a
   session waits for the next heartbeat while freed KV idles. A multi-turn workload closes
   admission for good, the loop's α taking over from where the reservations stand.
4. Allocate: workload w may hold σ_w of Σ_b α_b·C_b, σ_w ∝ π_w·K_w with a deficit correction;
   idle shares are lent, and lending stops (never preempts) once an owner has pending work.
   An owner below its share whose oldest session fits nowhere keeps the backend closest to
   fitting it for itself within the call (others place elsewhere), so the room freed there
   accumulates for it instead of being lent on to smaller sessions for good. An oldest session
   that names a model or an adapter blocks only the backends it may run on.
5. Admit, most under-served workload first, each workload oldest first, a GRPO group member
   by member: each goes to the backend with the longest cached-prefix match among those within
   `locality_slack` of the least-utilised and the balance slack of the least loaded, ties by
   headroom, so a group follows its prompt while that backend's batch stays in balance. While
   every first turn waiting fits in the caches' free KV, a match shorter than the session's
   learned output does not count. A backend takes a session only while its reservations
   fit α_b·C_b. Follow-up turns (`turn > 0`) go home unconditionally.

Switches (`MisaTConfig`) turn off each mechanism; the ablations `misa_t-admission`,
`misa_t-allocation` and `misa_t-residency` are MISA-T with that one switch off. The variant
`misa_t-paced` adds mixture pacing to step 5: a workload that finishes sooner than the mixture's
mean session and whose share of the expected completion rate is above π_w admits nothing more
while others run (misa_t_control.CompletionPacer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from broker.policies import register, register_factory
from broker.policies.base import Completion, Decision, Policy, Snapshot
from broker.policies.misa_t_admission import AdmissionRound, PrefixKeys
from broker.policies.misa_t_alpha import AlphaLoop
from broker.policies.misa_t_book import Book
from broker.policies.misa_t_charges import Predictions, Residency
from broker.policies.misa_t_control import AimdParams
from broker.policies.misa_t_predictors import PredictorParams
from broker.policies.misa_t_prefix import PrefixIndex


@dataclass(frozen=True, slots=True)
class MisaTConfig:
    adaptive_admission: bool = True  # off: α stays 1 (no AIMD)
    workload_allocation: bool = True  # off: no shares, no deficit; oldest first across workloads
    residency_accounting: bool = True  # off: charge prompt + max_tokens once, never re-charge
    prefix_placement: bool = True  # off: most headroom, no prefix index
    # Charge a session's expected end: "mean" = E[len | len > x] (what a sum over ~100
    # sessions per backend converges to); "quantile" = the length_quantile of that tail.
    tail_stat: str = "mean"
    length_quantile: float = 0.9  # used when tail_stat == "quantile"
    # Release a parked agentic session's charge when re-prefilling is cheaper than holding.
    # Off by default: a broker-placed session comes back to the *same* engine whatever the
    # ledger says, so a released charge is lent to new sessions that its next turn then
    # collides with (preemption). Only a router that re-places turns may release.
    release_parked: bool = False
    deficit_gain: float = 1.0  # σ_w scales by 1 + gain·relative consumed deficit, in [0.5, 2]
    # A workload below its share whose oldest session fits nowhere keeps the backend closest
    # to fitting it (most headroom) for itself within the call; off: pure work conservation.
    hold_for_blocked: bool = True
    # Mixture pacing (misa_t_control.CompletionPacer), off at inf: a workload in `pace_scope`
    # ("fast": finishing sooner than the mixture's mean session; "all") whose share of the
    # expected completion rate is above (1 + pace_tolerance)·π_w admits nothing more while
    # others run. It trades throughput for drift in fifo consumption (docs/results/misa-t.md §5,
    # revision 6); the `misa_t-paced` variant sets 0 and "fast".
    pace_tolerance: float = math.inf
    pace_scope: str = "fast"
    locality_slack: float = 0.15  # prefer a prefix match only within this KV utilisation of the least used ...
    # ... and within this many running sessions of the least loaded (at least
    # `balance_slack_sessions`, else `balance_slack_frac` of the mean): a decode batch piled on
    # one engine costs more than the prefills a prefix match saves.
    balance_slack_sessions: int = 1
    balance_slack_frac: float = 0.15
    recharge_tolerance: float = 0.05  # re-charge only when a charge moves by more than this fraction
    # Anticipate the growth of young residents (docs/misa-t.md, "The algorithm", step 3):
    # scale ρ_b by how much more of their charge single-turn residents will hold, judged by
    # finished sessions, once that factor is beyond `growth_noise_band`/√n of 1 (n such
    # residents: the spread of n sessions' context-per-charge around its mean is about 1/√n).
    anticipate_growth: bool = True
    growth_noise_band: float = 2.0
    # Re-evaluate a session's charge once it has produced this many tokens more (~6 s of decode
    # at ~40 tok/s), its turn or parking changed, or recheck_s passed (a tool wait ageing).
    recheck_tokens: int = 256
    recheck_s: float = 5.0
    # Re-prefill price (the h200-30b-a3b profile's a and c, docs/engine-model.md): seconds of
    # engine step time per recomputed token and per (query, key) pair of that recompute.
    prefill_s_per_token: float = 11e-6
    prefill_s_per_pair: float = 1.8e-9
    # Open admission (docs/misa-t.md, "The algorithm", step 3): once every workload of the
    # mixture has been seen and none is multi-turn, each backend admits up to `open_alpha`·C_b (the trainer's
    # in-flight bound binds first) and its engine queues what does not fit. Nothing is parked
    # between turns then, so the cache holds nothing that a preemption or an eviction would
    # cost a later turn, and vLLM preempts the request it scheduled last, whose recompute
    # mostly hits the prefix cache; holding sessions back in the broker only leaves freed KV
    # idle until the next heartbeat.
    open_single_turn: bool = True
    open_alpha: float = 100.0
    aimd: AimdParams = field(default_factory=AimdParams)
    predictors: PredictorParams = field(default_factory=PredictorParams)


@dataclass(frozen=True, slots=True)
class Call:
    """What one decide() call knows before it touches a backend."""

    now: float  # the snapshot's time
    next_charge: float | None  # the smallest charge among the sessions next in line
    open: bool  # admission open this call (`AlphaLoop.opens`)
    open_changed: bool  # ... and it was not in the last call (or the other way round)


@register
class MisaT(Policy):
    """The pipeline: `decide` runs the module docstring's steps, each a part of its own:
    `Predictions` and `Residency` (misa_t_charges.py: learn, and what a session is charged),
    `AlphaLoop` (misa_t_alpha.py: α per backend), `Book` (misa_t_book.py: steps 2 and 3 over
    the fleet, incrementally) and `AdmissionRound` (misa_t_admission.py: steps 4 and 5)."""

    name = "misa_t"

    def __init__(self, config: MisaTConfig | None = None, **overrides: Any) -> None:
        self.config = replace(config or MisaTConfig(), **overrides)
        self.predictions = self._make_predictions()
        self.residency = Residency(self.config, self.predictions)
        self.alpha_loop = AlphaLoop(self.config, self.predictions)
        self.prefix = PrefixIndex()
        self.book = Book(self.config, self.residency, self.alpha_loop, self.prefix)
        self.prefix_keys = PrefixKeys()

    def _make_predictions(self) -> Predictions:
        """What the charges are predicted with (misa_t-true-lengths gives the true lengths)."""
        return Predictions(self.config)

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = Decision()
        for c in snapshot.new_completions:  # 1. learn
            self.residency.learn(c)
        call = self._call(snapshot)
        accounted = self.book.account(snapshot, call, decision)  # 2. charge, 3. adapt α
        if accounted.placement.backends:  # 4. allocate, 5. admit
            AdmissionRound(self.config, self.predictions, self.residency, self.prefix,
                           self.prefix_keys, call, accounted, decision).run(snapshot)
            self.book.placed(decision.admissions)
        return decision

    def recall(self, history: Sequence[Completion]) -> None:
        self.predictions.recall(history)

    def _call(self, snapshot: Snapshot) -> Call:
        next_charge = self.predictions.smallest_head_charge(snapshot.pending)  # (models for the heads)
        loop = self.alpha_loop
        opened = loop.opens(snapshot, self.book.first_call)
        changed = opened != loop.open
        loop.open = opened
        return Call(snapshot.now, next_charge, opened, changed)


def _variant(name: str, **settings: Any) -> Callable[..., MisaT]:
    def make(**params: Any) -> MisaT:
        policy = MisaT(**{**settings, **params})
        policy.name = name
        return policy

    return make


register_factory("misa_t-admission", _variant("misa_t-admission", adaptive_admission=False))
register_factory("misa_t-allocation", _variant("misa_t-allocation", workload_allocation=False))
register_factory("misa_t-residency", _variant("misa_t-residency", residency_accounting=False))
# Not an ablation: MISA-T with mixture pacing, for fifo trainers that keep enough sessions in
# flight to fill the KV cache; where the trainer's buffer is the limit it costs throughput
# (docs/results/misa-t.md §5, revision 6).
register_factory("misa_t-paced", _variant("misa_t-paced", pace_tolerance=0.0))
