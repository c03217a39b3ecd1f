"""MISA-T's online predictors: what a real broker can learn from completions and heartbeats.

Everything here is fed only by `Completion` records, heartbeat progress and a session's public
fields (its caps). Nothing reads a simulator's truth: misa_t-true-lengths swaps the length
predictor for a lookup it is *given*, and that is the only side channel (misa_t_true_lengths.py).

- `TailWindow`: the last `size` samples of one quantity, kept sorted, with quantiles and the
  conditional tail the ledger charges by: "a session that has produced x tokens will end at
  the q-quantile of the lengths seen above x" (E[len | len > x] style, as a quantile so one
  rare monster does not set everyone's charge). Until `min_samples` arrive it answers from a
  conservative prior (the cap).
- `RatioWindow`: Σ numerators / Σ denominators over the last `size` pairs: how much KV finished
  sessions held per token they were charged, over their whole residency.
- `WorkloadModel`: per workload, the windows the policy needs — output per turn, final context
  of multi-turn sessions, tool wait per gap, admission-to-finish time, KV held per token charged
  — and K_w, the mean KV·token-seconds per session.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass

from broker.policies.base import Completion, kv_token_seconds


class TailWindow:
    """A sliding window of the latest samples, sorted for O(log n) quantile queries.

    Invariant: `sorted` holds exactly the values of `recent` (a multiset), in order.
    """

    __slots__ = ("size", "min_samples", "prior", "recent", "sorted", "_tail_sums", "_mean")

    def __init__(self, size: int, min_samples: int, prior: float) -> None:
        self.size = size
        self.min_samples = min_samples
        self.prior = prior  # answer for every query while the window is too small
        self.recent: deque[float] = deque()
        self.sorted: list[float] = []
        # sum(sorted[i:]) by i, for the window as it is (a decide() asks the same few many times)
        self._tail_sums: dict[int, float] = {}
        self._mean: float | None = None  # mean() of the window as it is

    @property
    def warm(self) -> bool:
        return len(self.recent) >= self.min_samples

    def add(self, value: float) -> None:
        self._tail_sums.clear()
        self._mean = None
        self.recent.append(value)
        insort(self.sorted, value)
        if len(self.recent) > self.size:
            old = self.recent.popleft()
            del self.sorted[bisect_right(self.sorted, old) - 1]

    def quantile(self, q: float) -> float:
        if not self.warm:
            return self.prior
        s = self.sorted
        return s[min(len(s) - 1, int(q * len(s)))]

    def tail_quantile(self, x: float, q: float) -> float:
        """The q-quantile of the samples above x: where a session past x is expected to end.

        With fewer than `min_samples` samples above x the window knows nothing about that
        tail; the answer is then the prior (the cap), the conservative end.
        """
        tail = self._tail(x)
        if tail is None:
            return max(self.prior, x)
        s, lo, above = tail
        return s[lo + min(above - 1, int(q * above))]

    def expected_end(self, x: float) -> float:
        """E[v | v > x]: where something past x is expected to end, on average.

        Like `tail_quantile`, the prior (the cap) answers while fewer than `min_samples`
        samples lie above x. A mean, not a high quantile: the ledger sums the charges of ~100
        sessions per backend, and a sum of means is what their total converges to; a sum of
        90th percentiles overstates it ~2× for rlvr's lognormal and leaves half the cache idle.
        """
        tail = self._tail(x)
        if tail is None:
            return max(self.prior, x)
        s, lo, above = tail
        total = self._tail_sums.get(lo)
        if total is None:
            total = self._tail_sums[lo] = sum(s[lo:])
        return total / above

    def _tail(self, x: float) -> tuple[list[float], int, int] | None:
        """(sorted samples, index of the first above x, how many are above), or None when the
        window is cold or knows fewer than `min_samples` samples above x."""
        if not self.warm:
            return None
        s = self.sorted
        lo = bisect_right(s, x)
        above = len(s) - lo
        return None if above < self.min_samples else (s, lo, above)

    def tail_mean(self, x: float) -> float:
        """E[v − x | v > x]: how much longer something that has lasted x is expected to last."""
        if not self.warm:
            return self.prior
        s = self.sorted
        lo = bisect_right(s, x)
        if lo == len(s):
            return self.prior
        tail = s[lo:]
        return sum(tail) / len(tail) - x

    def mean(self) -> float:
        if not self.warm:
            return self.prior
        if self._mean is None:  # (asked on every decide(), changed only by a completion)
            self._mean = sum(self.recent) / len(self.recent)
        return self._mean


class RatioWindow:
    """Σ num / Σ den over the latest `size` (num, den) pairs; None until `min_samples` arrive.

    A ratio of sums, not a mean of ratios: each pair weighs by its denominator (a session by
    the charge-seconds it held), as the KV of a backend's residents does."""

    __slots__ = ("size", "min_samples", "recent", "num", "den")

    def __init__(self, size: int, min_samples: int) -> None:
        self.size = size
        self.min_samples = min_samples
        self.recent: deque[tuple[float, float]] = deque()
        self.num = 0.0
        self.den = 0.0

    def add(self, num: float, den: float) -> None:
        self.recent.append((num, den))
        self.num += num
        self.den += den
        if len(self.recent) > self.size:
            old_num, old_den = self.recent.popleft()
            self.num -= old_num
            self.den -= old_den

    def ratio(self) -> float | None:
        if len(self.recent) < self.min_samples or self.den <= 0:
            return None
        return self.num / self.den


@dataclass(frozen=True, slots=True)
class PredictorParams:
    window: int = 512  # samples kept per quantity: recent enough to follow a length curriculum
    min_samples: int = 16  # below this a window answers with its prior
    prior_tool_wait_s: float = 2.0  # seconds per gap before any agentic completion (order of [TL3])
    prior_decode_tok_s: float = 40.0  # per-stream decode speed for the K_w prior (≈24 ms/token [G3])


class WorkloadModel:
    """What MISA-T knows about one workload, learned from its completions."""

    def __init__(self, max_tokens: int, max_turns: int, params: PredictorParams) -> None:
        p = params
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.turn_output = TailWindow(p.window, p.min_samples, float(max_tokens))
        self.turns = TailWindow(p.window, p.min_samples, float(max_turns))
        self.tool_wait = TailWindow(p.window, p.min_samples, p.prior_tool_wait_s)
        self.kv_seconds = TailWindow(p.window, p.min_samples, 0.0)
        # Largest context a multi-turn session reached (from heartbeats): its KV peak.
        self.final_context = TailWindow(p.window, p.min_samples, 0.0)
        self.decode_tok_s = p.prior_decode_tok_s  # the K_w prior's per-stream decode rate
        self.prompt_mean = 0.0  # EWMA of first-turn prompt tokens (for the K_w prior)
        self.duration = TailWindow(p.window, p.min_samples, 0.0)  # admitted -> finished, seconds
        # ∫ KV held dt / ∫ charge dt of finished single-turn sessions, over their residency:
        # what the ratio of used to charged KV comes to once residents of every age are mixed.
        self.held_per_charged = RatioWindow(p.window, p.min_samples)

    def note_prompt(self, prompt_tokens: int) -> None:
        if self.prompt_mean == 0.0:
            self.prompt_mean = float(prompt_tokens)
        else:
            self.prompt_mean += 0.05 * (prompt_tokens - self.prompt_mean)

    def observe(self, c: Completion, peak_context: int = 0) -> None:
        for n in c.turn_output_tokens:
            self.turn_output.add(float(n))
        self.turns.add(float(c.turns))
        if c.turns > 1:
            self.tool_wait.add(c.tool_wait_s / (c.turns - 1))
        self.kv_seconds.add(c.kv_token_seconds)
        self.duration.add(c.finished_at - c.admitted_at)
        if c.turns > 1:
            self.final_context.add(float(max(peak_context, c.prompt_tokens + c.output_tokens)))

    def duration_s(self) -> float:
        """Mean seconds from admission to finish; before enough completions, from the caps."""
        if self.duration.warm:
            return self.duration.mean()
        length = self.turn_output.quantile(0.5)
        turns = self.turns.quantile(0.5)
        return turns * length / self.decode_tok_s + (turns - 1) * self.tool_wait.quantile(0.5)

    def kv_seconds_per_session(self) -> float:
        """K_w: mean KV·token-seconds a session of this workload holds over its residency
        (`base.kv_token_seconds`, the definition completions report).

        Before enough completions, a prior from the caps: turns of L tokens decoded at r tok/s
        (L/r seconds each) on a history that grows by L per turn from the mean prompt, with
        the median tool wait between turns.
        """
        if self.kv_seconds.warm:
            return self.kv_seconds.mean()
        length = self.turn_output.quantile(0.5)
        turns = max(1, round(self.turns.quantile(0.5)))
        prompt = self.prompt_mean
        wait = self.tool_wait.quantile(0.5)
        return kv_token_seconds(
            [(round(prompt + k * length), round(length), length / self.decode_tok_s)
             for k in range(turns)],
            [(round(prompt + (k + 1) * length), wait) for k in range(turns - 1)])
