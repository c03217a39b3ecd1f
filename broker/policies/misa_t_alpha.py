"""MISA-T's α per backend: step 3 of `misa_t.py`.

`AlphaLoop` keeps, per backend, the loop's α, the last heartbeat it stepped on, since when the
engine has been calm, and ρ_b (KV in use per token charged); `adapt` steps α on a fresh
heartbeat with the AIMD rule of misa_t_control.AimdParams. It also decides whether admission
is open this call (`opens`) and so which α the ledger holds (`ledger_alpha`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.policies.base import BackendView, Snapshot, Telemetry
from broker.policies.misa_t_charges import Predictions

if TYPE_CHECKING:
    from broker.policies.misa_t import MisaTConfig


class AlphaLoop:
    def __init__(self, config: MisaTConfig, predictions: Predictions) -> None:
        self.config = config
        self.predictions = predictions
        self.alpha: dict[str, float] = {}  # the loop's α_b
        self.open = False  # admission open in the current call (`opens`)
        self._last_hb: dict[str, Telemetry] = {}
        self._calm_since: dict[str, float] = {}
        self._usage_ratio: dict[str, float | None] = {}  # ρ_b: KV in use per token charged

    def opens(self, snapshot: Snapshot, first_call: bool) -> bool:
        """Whether admission is open this call: every workload of the mixture has been seen
        (a workload's kind is that of the first session seen of it: its `WorkloadModel`, the
        head of its queue, or on the first call a resident) and none runs more than one turn.
        A multi-turn workload closes it for good: its histories sit in the prefix cache between
        turns, where over-admission evicts them, and its returning turns are the requests vLLM
        preempts first. One not seen yet keeps it closed: its kind is unknown; so does a
        trainer that has set no mixture (the workloads to come are not known). Called after
        `Predictions.smallest_head_charge`, which has made the models of the queues' heads."""
        if not (self.config.open_single_turn and self.config.adaptive_admission):
            return False
        predict = self.predictions
        if first_call and not predict.multi_turn_seen:  # a restarted broker's residents
            for v in snapshot.backends:
                for r in v.sessions:
                    predict.model(r.workload, r.max_tokens, r.max_turns)
        if predict.multi_turn_seen:
            return False
        declared = [w for w, pi in snapshot.mixture_target.items() if pi > 0]
        return bool(declared) and all(w in predict.models for w in declared)

    def is_fresh(self, view: BackendView) -> bool:
        """Whether the view carries a heartbeat newer than the last one `adapt` saw."""
        hb = view.telemetry
        last = self._last_hb.get(view.backend_id)
        return hb is not None and (last is None or hb.at > last.at)

    def adapt(self, view: BackendView, fresh: bool, next_charge: float | None,
              reserved: float, growth: float, now: float) -> None:
        """Set the loop's α_b after this heartbeat (AIMD on the engine's own signals when it
        is fresh); the loop reads ρ_b scaled by `growth` (`Residency.growth`)."""
        cfg = self.config
        b = view.backend_id
        alpha = self.alpha.get(b)
        if alpha is None:
            alpha = self._first_alpha(view, reserved)
        calm_since = self._calm_since.setdefault(b, now)
        hb = view.telemetry
        if fresh:
            if cfg.adaptive_admission:
                before = self._last_hb.get(b)
                ratio = cfg.aimd.usage_ratio(self._usage_ratio.get(b), hb, reserved,
                                             view.capacity_tokens)
                self._usage_ratio[b] = ratio
                if ratio is not None:
                    ratio *= growth
                alpha = cfg.aimd.step(alpha, hb, before, next_charge=next_charge,
                                      reserved=reserved, capacity=view.capacity_tokens,
                                      ratio=ratio, calm_for=hb.at - calm_since)
                if cfg.aimd.backed_off(hb, before):
                    self._calm_since[b] = hb.at
            self._last_hb[b] = hb
        if self.open and not view.shared:
            # While admission is open the loop's α follows the reservations, so that it
            # closes where the ledger stands instead of far below it.
            alpha = min(cfg.aimd.alpha_max,
                        max(cfg.aimd.alpha_min, reserved / view.capacity_tokens, alpha))
        self.alpha[b] = alpha

    def _first_alpha(self, view: BackendView, reserved: float) -> float:
        """α of a backend the loop has not seen: a restarted broker resumes from the ledger's
        (capped: the ledger holds open_alpha while admission was open); without AIMD α is the
        ledger's own meaning, reservations may reach C_b."""
        cfg = self.config
        if not cfg.adaptive_admission:
            return 1.0
        first = min(view.alpha, cfg.aimd.alpha_max) if view.alpha > 0 else 1.0
        if first == 1.0 and reserved == 0 and self.predictions.cold and not view.shared:
            # A backend that starts with the run (the ledger's registration α, nothing
            # reserved) while no workload has learned its lengths: every charge sits at its
            # length cap, several times what sessions end up holding, and at α = 1 the fleet
            # starts a fraction full and fills over seconds of heartbeats while a router sends
            # everything at once. It starts at the guard instead; the loop takes over at its
            # first heartbeat (docs/results/misa-t.md §14). Not on an engine other namespaces
            # share: there each job's part holds only while its reservations bind (as for open
            # admission, `ledger_alpha`).
            return cfg.aimd.alpha_max
        return first

    def ledger_alpha(self, view: BackendView) -> float:
        """The α the ledger holds for a backend: `open_alpha` while admission is open, else
        the loop's. Admission never opens on an engine other namespaces share: their
        guaranteed shares hold only while each namespace's reservations bind (an engine queue
        filled by one job would serve it first)."""
        b = view.backend_id
        return self.config.open_alpha if self.open and not view.shared else self.alpha[b]

    def forget(self, b: str) -> None:
        """Backend b left the fleet (its α stays, for a return)."""
        self._last_hb.pop(b, None)
        self._usage_ratio.pop(b, None)
