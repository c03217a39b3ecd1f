"""What MISA-T charges each session: steps 1 and 2 of `misa_t.py`.

- `Predictions`: one `WorkloadModel` per workload (misa_t_predictors.py), made from the first
  session seen of it, and what they predict: where a turn ends, a multi-turn session's KV
  peak, the charge of a session waiting to start. misa_t-true-lengths swaps in the true
  lengths (`TrueLengths`, misa_t_true_lengths.py).
- `Residency`: what the policy remembers of each admitted session between heartbeats (a
  `_Track`), completions fed back to the models, and the charge of a resident session on a
  fresh heartbeat (the residency rule in the module docstring of misa_t.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.policies.base import (
    BackendView,
    Completion,
    Decision,
    PendingItem,
    ResidentSession,
    default_reservation,
)
from broker.policies.misa_t_predictors import WorkloadModel

if TYPE_CHECKING:
    from broker.policies.misa_t import MisaTConfig


class Predictions:
    """The per-workload models and what the charges are made of."""

    def __init__(self, config: MisaTConfig) -> None:
        self.config = config
        self.models: dict[str, WorkloadModel] = {}
        self.multi_turn_seen = False  # a workload's model has max_turns > 1
        self.max_len = 1 << 30  # smallest max_model_len seen: no context exceeds it
        # Recalled completions of workloads without a model yet (`recall`): they need its caps.
        self._recalled: dict[str, list[Completion]] = {}

    @property
    def cold(self) -> bool:
        """Whether no workload has learned its turn lengths yet (recalled completions count):
        every charge then sits at its length cap."""
        return not any(m.turn_output.warm for m in self.models.values()) and not self._recalled

    def model(self, workload: str, max_tokens: int, max_turns: int) -> WorkloadModel:
        """The workload's model, seeded from these caps if it is the first session seen, and
        from the completions recalled for it."""
        model = self.models.get(workload)
        if model is None:
            model = WorkloadModel(max_tokens, max_turns, self.config.predictors)
            self.models[workload] = model
            self.multi_turn_seen |= max_turns > 1
            for c in self._recalled.pop(workload, ()):
                model.observe(c)
        return model

    def recall(self, history: Sequence[Completion]) -> None:
        """Learn from completions of an earlier incarnation (`Policy.recall`), oldest first.
        A workload's model is made from its first session's caps; until then its completions
        wait (each model keeps only its last window of them anyway)."""
        for c in history:
            model = self.models.get(c.workload)
            if model is not None:
                model.observe(c)
            else:
                self._recalled.setdefault(c.workload, []).append(c)

    def admission_output(self, s: PendingItem | ResidentSession) -> float:
        """Output tokens to charge for the turn `s` starts next: a new placement's first (or
        current) turn, or a parked session's next one."""
        model = self.model(s.workload, s.max_tokens, s.max_turns)
        return min(s.max_tokens, self._turn_end(model, 0.0))

    def learned_output(self, s: PendingItem) -> float | None:
        """`admission_output(s)` once the workload has learned its turn lengths; None while
        it is charged at its cap."""
        model = self.model(s.workload, s.max_tokens, s.max_turns)
        return self.admission_output(s) if model.turn_output.warm else None

    def turn_output(self, session: ResidentSession, turn_index: int, progress: int) -> float:
        """Where the running turn is expected to end, given `progress` tokens so far."""
        model = self.model(session.workload, session.max_tokens, session.max_turns)
        end = self._turn_end(model, progress)
        return min(session.max_tokens, max(end, progress + 1))

    def _turn_end(self, model: WorkloadModel, progress: float) -> float:
        if self.config.tail_stat == "quantile":
            return model.turn_output.tail_quantile(progress, self.config.length_quantile)
        return model.turn_output.expected_end(progress)

    def peak_estimate(self, workload: str, context: float) -> float:
        """A multi-turn session's expected KV peak given the context it has reached:
        E[final context | final > context] once enough sessions have finished, else 0 (the
        per-turn charge alone then covers the running turn and is raised turn by turn)."""
        if self.config.tail_stat != "mean":
            return 0.0
        model = self.models.get(workload)
        if model is None or not model.final_context.warm:
            return 0.0
        return min(model.final_context.expected_end(context), float(self.max_len))

    def charge(self, item: PendingItem) -> float:
        """The KV tokens a session waiting to start is charged when it is admitted."""
        self.model(item.workload, item.max_tokens, item.max_turns)  # seeded from its caps
        if not self.config.residency_accounting:
            return float(default_reservation(item))
        charge = item.prompt_tokens + self.admission_output(item)
        if item.max_turns > 1:
            charge = max(charge, self.peak_estimate(item.workload, item.prompt_tokens))
        return charge

    def same_charge(self, item: PendingItem, other: PendingItem) -> bool:
        """Whether `item` is charged what `other` is without asking (`charge` reads only these
        fields: a GRPO group's members share them)."""
        return (item.workload == other.workload and item.prompt_tokens == other.prompt_tokens
                and item.max_tokens == other.max_tokens and item.max_turns == other.max_turns)

    def smallest_head_charge(self, pending: Mapping[str, Sequence[PendingItem]]) -> float | None:
        """The smallest charge among the sessions next in line to start (each workload's oldest
        first turn; follow-up turns go home whatever α says); None when none waits."""
        smallest = None
        for items in pending.values():
            for item in items:
                if not item.turn:
                    charge = self.charge(item)
                    if smallest is None or charge < smallest:
                        smallest = charge
                    break
        return smallest

    def kv_seconds(self, fresh: Mapping[str, Sequence[PendingItem]],
                   target: Mapping[str, float]) -> dict[str, float]:
        """K_w per workload. Without residency accounting, the static charge instead (KV
        tokens, not token-seconds): what an accounting blind to residency time would use."""
        out = {}
        for w in target:
            model = self.models.get(w)
            if model is None:
                if w not in fresh:
                    continue
                head = fresh[w][0]
                model = self.model(w, head.max_tokens, head.max_turns)
                model.note_prompt(head.prompt_tokens)
            if self.config.residency_accounting:
                out[w] = model.kv_seconds_per_session()
            else:
                out[w] = model.prompt_mean + model.max_tokens * model.max_turns
        return out

    def durations(self, workloads: Mapping[str, float],
                  fresh: Mapping[str, Sequence[PendingItem]]) -> dict[str, float]:
        """Each workload's mean admission-to-finish time (for the mixture pacer)."""
        duration: dict[str, float] = {}
        for w in workloads.keys() | fresh.keys():
            model = self.models.get(w)
            if model is None and w in fresh:
                head = fresh[w][0]
                model = self.model(w, head.max_tokens, head.max_turns)
            if model is not None:
                duration[w] = max(model.duration_s(), 1e-3)
        return duration


@dataclass(slots=True)
class _Track:
    """What the policy remembers of one admitted session between heartbeats."""

    turn: int = -1  # last turn number seen in a heartbeat
    turn_base: int = 0  # generated_tokens when that turn was first seen (its progress origin)
    parked_since: float | None = None  # first heartbeat time seen waiting on a tool
    checked_tokens: int = -1  # generated_tokens when the charge was last computed
    checked_parked: bool = False  # waiting_on_tool then
    checked_at: float = 0.0  # heartbeat time then
    peak_context: int = 0  # largest context seen in a heartbeat (a multi-turn session's KV peak)
    # The ledger's charge in force since `charged_at`, and ∫ charge dt before that since the
    # admission; None for a session this policy object did not admit (a restarted broker's).
    charge: float = 0.0
    charged_at: float = 0.0
    charge_seconds: float | None = None

    def hold(self, now: float, charge: float) -> None:
        """The ledger charges `charge` from `now` on (what it charged before counts until now)."""
        if self.charge_seconds is not None:
            self.charge_seconds += self.charge * max(0.0, now - self.charged_at)
        self.charge, self.charged_at = charge, now


class Residency:
    """The admitted sessions' tracks and the charge of each on a fresh heartbeat."""

    def __init__(self, config: MisaTConfig, predictions: Predictions) -> None:
        self.config = config
        self.predictions = predictions
        self.tracks: dict[str, _Track] = {}

    def admitted(self, item: PendingItem, charge: float, now: float) -> None:
        """`item` was admitted with `charge`: track it from now on."""
        if item.turn == 0:  # each session's prompt counts once, when it is placed
            self.predictions.models[item.workload].note_prompt(item.prompt_tokens)
        self.tracks[item.session_id] = _Track(charge=float(int(charge)), charged_at=now,
                                              charge_seconds=0.0)

    def learn(self, c: Completion) -> None:
        """Feed a completion to its workload's model and stop tracking the session."""
        model = self.predictions.models.get(c.workload)
        if model is None:
            return  # never admitted by this policy object: no caps known to seed a prior
        track = self.tracks.pop(c.session_id, None)
        model.observe(c, track.peak_context if track is not None else 0)
        if track is not None and track.charge_seconds is not None and model.max_turns <= 1:
            track.hold(c.finished_at, 0.0)
            if track.charge_seconds > 0:
                model.held_per_charged.add(c.kv_token_seconds, track.charge_seconds)

    def recharge(self, s: ResidentSession, view: BackendView, now: float,
                 decision: Decision) -> float:
        """The charge of resident `s` after this heartbeat (a new one goes in
        `decision.recharge` when it moves by more than the tolerance)."""
        cfg = self.config
        track = self.tracks.get(s.session_id)
        if track is None:  # admitted by a previous broker incarnation: start tracking now
            track = _Track()
            self.tracks[s.session_id] = track
        if s.context_tokens > track.peak_context:
            track.peak_context = s.context_tokens
        track.hold(now, float(s.reserved_tokens))  # what the ledger charges (it may refuse a growth)
        if (
            s.generated_tokens - track.checked_tokens < cfg.recheck_tokens
            and s.waiting_on_tool == track.checked_parked
            and s.turn == track.turn
            and now - track.checked_at < cfg.recheck_s
        ):
            return float(s.reserved_tokens)  # nothing moved enough to change the charge
        track.checked_tokens, track.checked_parked, track.checked_at = (
            s.generated_tokens, s.waiting_on_tool, now)
        charge = self.residency_charge(s, track, view, now)
        if abs(charge - s.reserved_tokens) > cfg.recharge_tolerance * max(s.reserved_tokens, 1):
            decision.recharge[s.session_id] = int(charge)
            track.hold(now, float(int(charge)))
            return float(int(charge))
        return float(s.reserved_tokens)

    def residency_charge(
        self, s: ResidentSession, track: _Track, view: BackendView, now: float
    ) -> float:
        """The KV tokens session `s` should be charged now (docs/misa-t.md)."""
        predict = self.predictions
        if s.turn != track.turn:
            track.turn, track.turn_base = s.turn, s.generated_tokens
        if s.max_turns <= 1:
            end = predict.turn_output(s, 0, s.generated_tokens)
            return s.prompt_tokens + end
        if s.waiting_on_tool:
            if track.parked_since is None:
                track.parked_since = now
            if self.config.release_parked and not self.hold_is_cheaper(
                s.workload, s.context_tokens, now - track.parked_since, view
            ):
                return 0.0
            charge = s.context_tokens + predict.admission_output(s)
        else:
            track.parked_since = None
            progress = max(0, s.generated_tokens - track.turn_base)
            end = predict.turn_output(s, max(0, s.turn - 1), progress)
            charge = s.context_tokens + max(0.0, end - progress)
        return max(charge, predict.peak_estimate(s.workload,
                                                 max(s.context_tokens, track.peak_context)))

    def hold_is_cheaper(self, workload: str, history: int, waited: float, view: BackendView) -> bool:
        """Keep a parked session's history charged iff holding it for the expected rest of the
        tool wait costs fewer KV·token-seconds than re-prefilling it would.

        Holding: history × E[wait − waited | wait > waited]. Re-prefill: its engine time
        (a·H + c·H²/2 — chunked prefill stretches steps for the whole batch) times the KV
        resident on that backend, which sits idle-in-place for that long.
        """
        cfg = self.config
        model = self.predictions.models.get(workload)
        remaining = model.tool_wait.tail_mean(waited) if model else cfg.predictors.prior_tool_wait_s
        prefill_s = cfg.prefill_s_per_token * history + cfg.prefill_s_per_pair * history * history / 2
        usage = view.telemetry.kv_usage if view.telemetry is not None else 0.0
        resident = max(usage * view.capacity_tokens, history)
        return history * remaining <= prefill_s * resident

    def growth(self, charged: Mapping[str, float], residents: Mapping[str, int],
               in_use: float) -> float:
        """The factor ρ_b is scaled by: how much more of what they are charged a backend's
        residents will hold, judged by the finished sessions of their workloads (`charged`:
        their charges per workload; `residents`: how many per workload; `in_use`: the KV
        tokens the engine reports in use now).

        A finished single-turn session held `held_per_charged` (∫KV dt / ∫charge dt) over its
        residency; residents of every age, mixed as a steady state mixes them, hold that ratio
        of their charges now. Residents that hold less (a cohort admitted together: prompts
        in KV, expected ends charged) will grow into it. The factor is
        (Σ_w ratio_w·charged_w) / in_use, where a workload with no learned ratio (too few
        finished sessions, or multi-turn sessions) is taken to hold what it is charged times
        the engine's measured ρ_b = in_use / Σ charged; 1 where it does not pass the noise
        band, or is below 1 (older residents: what the engine holds already says it).

        What the engine holds, not the residents' context tokens: a worker learns a turn's
        output when the turn ends, so until then a session's context is its prompt, and a
        factor over contexts grew without bound on long outputs (docs/misa-t.md)."""
        total_charged = sum(charged.values())
        if in_use <= 0 or total_charged <= 0:
            return 1.0
        expected = 0.0
        n = 0  # residents of workloads with a learned ratio
        for w, count in residents.items():
            model = self.predictions.models.get(w)
            ratio = model.held_per_charged.ratio() if model is not None else None
            if ratio is None:
                expected += in_use * charged[w] / total_charged
            else:
                expected += ratio * charged[w]
                n += count
        if n == 0:
            return 1.0
        factor = expected / in_use
        return factor if factor >= 1.0 + self.config.growth_noise_band / math.sqrt(n) else 1.0
