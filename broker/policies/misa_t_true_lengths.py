"""misa_t-true-lengths: MISA-T with its output-length predictor replaced by the true lengths.

A reference, not a policy anyone can deploy, and not an upper bound either: it answers "what
would MISA-T's machinery do with perfect length predictions", which is not the best any policy
can do (it lost to `misa_t` on paper-mixed; the bench's fluid bound, `sim/bound.py`, is the
ceiling). Everything else (accounting, AIMD α, workload shares, placement) is MISA-T's own code;
the only difference is where an output length comes from. The bench passes
`true_output_lengths`, a function session_id → true per-turn output lengths, and that function
is its only side channel: it still sees the world through `Snapshot` like any other policy.
Tool waits, observations and turn counts stay predicted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.policies import register
from broker.policies.base import PendingItem, ResidentSession
from broker.policies.misa_t import MisaT
from broker.policies.misa_t_charges import Predictions


class TrueLengths(Predictions):
    """MISA-T's predictions with a turn's output length looked up, where the lookup knows it."""

    def __init__(self, config: Any, true_output_lengths: Callable[[str], tuple[int, ...]]) -> None:
        super().__init__(config)
        self._lengths = true_output_lengths

    def _true(self, session_id: str, turn_index: int) -> int | None:
        lengths = self._lengths(session_id)
        return lengths[turn_index] if 0 <= turn_index < len(lengths) else None

    def admission_output(self, s: PendingItem | ResidentSession) -> float:
        """The true length of the turn `s` starts next (`turn` is that turn's index for a
        pending item and a parked session alike)."""
        n = self._true(s.session_id, s.turn)
        return float(n) if n is not None else super().admission_output(s)

    def same_charge(self, item: PendingItem, other: PendingItem) -> bool:
        return False  # each session's own true length

    def turn_output(self, session: ResidentSession, turn_index: int, progress: int) -> float:
        n = self._true(session.session_id, turn_index)
        if n is None:
            return super().turn_output(session, turn_index, progress)
        return float(max(n, progress + 1))


@register
class MisaTTrueLengths(MisaT):
    name = "misa_t-true-lengths"
    simulator_only = True

    def __init__(
        self, true_output_lengths: Callable[[str], tuple[int, ...]], **params: Any
    ) -> None:
        self._lengths = true_output_lengths  # (read by _make_predictions during __init__)
        super().__init__(**params)

    def _make_predictions(self) -> Predictions:
        return TrueLengths(self.config, self._lengths)
