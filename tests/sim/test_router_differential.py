"""Differential test: the real vLLM Router's cache_aware choices against our `CacheAware`.

One sequence of /v1/completions requests goes, one at a time, through `vllm-router` 0.1.17 in
front of three sim engines; where each ran is read off the engines (RouterRig, in
tests/sim/test_vllm_router.py). The same sequence drives our policy
(broker/policies/cache_aware.py) the way the fleet simulator does: for every request, a snapshot
of the same three workers in the router's own worker order (its least-loaded scan breaks ties by
it), each with the router's in-flight count (its GET /workers) as `in_flight`, and one pending
item whose `prefix` is the router's key for the prompt; the policy places it and we compare,
request by request. After a disagreement the policy's tree would be rebuilt from the router's
actual placements, so every comparison is conditioned on the real history.

Load: some requests are "pinned" (long, streamed, in flight until unpinned), so the router sees
uneven loads; the rest complete before the next request is sent, and the router's counts are
settled before every request, so each decision is made on a known state (no timing races).

What the router matches, learned by probing it and asserted below through crafted probes whose
two possible answers are different engines:
- tokens, not characters: before routing, the router asks a worker's POST
  /v1/completions/render for the prompt's token ids (the sim engine serves that route as vLLM
  does) and matches those, so a text prompt's key is its tokenization. Probes whose character
  match rate and token match rate fall on opposite sides of the threshold go where the token
  rate says; a model keyed by characters (`char_key`) would send them the other way.
- whole tokens: a token id's encoding that shares leading digits with the next stored token
  earns no partial credit (a match of exactly threshold × length tokens stays below it).
- the threshold test is `matched / length > f32(cache_threshold)` with the rate in double
  precision: 30/100 does not clear 0.3, 70/100 clears 0.7 (f32(0.7) = 0.69999998), 71/100 does.
- ties go to the least loaded of the best-matching workers, then by the router's worker order.

Two router configurations: its defaults (0.3, 64, 1.5), and a tight one (cache_threshold 0.7,
balance_abs_threshold 2, balance_rel_threshold 1.5) that reaches the imbalanced branch with a
handful of pinned requests. The router's tree eviction (first after 120 s) never runs within a
test; the policy gets eviction_interval_s=0.
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import pytest

from broker.policies.base import BackendView, PendingItem, ResidentSession, Snapshot
from broker.policies.cache_aware import CacheAware
from broker.policies.router_base import least_loaded
from tests.sim.test_vllm_router import (
    MODEL,
    RouterRig,
    processes,
    start_engine,
    start_router,
)

pytestmark = pytest.mark.integration

ID_LOW, ID_HIGH = 1_000, 100_000  # token ids for prompts: above the byte and special ids
Prompt = list[int] | str
Key = Callable[[Prompt], tuple[int, ...]]


def render_key(engine: str) -> Key:
    """The router's key for a prompt: the token ids a worker renders it to."""
    def key(prompt: Prompt) -> tuple[int, ...]:
        response = httpx.post(engine + "/v1/completions/render",
                              json={"model": MODEL, "prompt": prompt}, timeout=10)
        response.raise_for_status()
        (rendered,) = response.json()
        return tuple(rendered["token_ids"])
    return key


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def char_key(prompt: Prompt) -> tuple[int, ...]:
    """A text prompt as characters: what a router matching raw text would compare."""
    return tuple(map(ord, prompt)) if isinstance(prompt, str) else tuple(prompt)


@dataclass(frozen=True)
class Op:
    kind: str  # "run": a request that completes; "pin": one that stays in flight; "unpin"
    prompt: Prompt | None = None
    label: str = ""
    pin: int | None = None  # for "unpin": which pin, by number
    expect: str | None = None  # for a crafted probe: the branch of the rule that must decide
    granularity: bool = False  # a probe where characters and tokens disagree on the threshold
    tie: bool = False  # a probe whose best match is on several engines with different loads


def _resident(session_id: str) -> ResidentSession:
    return ResidentSession(session_id=session_id, workload="w", group_id=None, reserved_tokens=1,
                           prompt_tokens=1, context_tokens=1, generated_tokens=0, turn=0,
                           max_tokens=1, max_turns=1, waiting_on_tool=False, admitted_at=0.0)


def _backend(url: str, in_flight: int) -> BackendView:
    return BackendView(backend_id=url, capacity_tokens=400_000, max_model_len=32_768,
                       healthy=True, alpha=1.0, telemetry=None,
                       sessions=tuple(_resident(f"{url}#{i}") for i in range(in_flight)))


@dataclass
class Model:
    """Our CacheAware on prompts keyed by `key`, kept on the router's actual history."""

    params: dict[str, float | int]
    key: Key
    history: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    policy: CacheAware = field(init=False)

    def __post_init__(self) -> None:
        self.policy = CacheAware(**self.params, eviction_interval_s=0)

    def branch(self, prefix: tuple[int, ...], loads: dict[str, int]) -> tuple[str, list[str]]:
        """Which branch of the rule decides, and the best-matching workers in order (read
        before the tree learns this request)."""
        matched = self.policy.tree.match_lengths(prefix)
        rates = {b: matched.get(b, 0) / len(prefix) for b in loads}
        best = [b for b in loads if rates[b] == max(rates.values())]
        if self.policy.is_imbalanced(min(loads.values()), max(loads.values())):
            return "imbalanced", best
        clears = rates[best[0]] > f32(self.policy.cache_threshold)
        return ("match" if clears else "low_match"), best

    def choose(self, n: int, prefix: tuple[int, ...],
               loads: dict[str, int]) -> tuple[str, str, list[str]]:
        branch, best = self.branch(prefix, loads)
        item = PendingItem(session_id=f"r{n}", workload="w", group_id=None, group_size=1,
                           prompt_tokens=len(prefix), prefix=prefix, max_tokens=1, max_turns=1,
                           turn=0, home_backend=None, enqueued_at=float(n))
        snapshot = Snapshot(now=0.0, pending={"w": (item,)},
                            backends=tuple(_backend(u, load) for u, load in loads.items()),
                            mixture_target={"w": 1.0}, consumed={})
        (admission,) = self.policy.decide(snapshot).admissions
        return admission.backend_id, branch, best

    def record(self, prefix: tuple[int, ...], actual: str, predicted: str) -> None:
        self.history.append((prefix, actual))
        if predicted != actual:  # resync: the tree as the router's placements built it
            self.policy = CacheAware(**self.params, eviction_interval_s=0)
            for past, backend in self.history:
                self.policy.tree.insert(past, backend)


@dataclass
class Step:
    n: int
    op: Op
    loads: dict[str, int]  # the router's, when it decided
    router: str  # where the request ran
    ours: str  # where our CacheAware put it
    branch: str  # the branch of the rule that decided ours
    best: list[str]  # the workers with the best match rate, in the router's order
    least_loaded: str  # where plain least-loaded routing would have put it
    by_chars: str  # where our CacheAware keyed by characters would have put it


def crafted(params: dict[str, float | int], rng: random.Random) -> list[Op]:
    """Probes at known match rates, each decided against plain least-loaded or with it.

    A segment sends a base prompt, pins a near-copy of it (so the base's engine gains a request
    and is no longer the least loaded), then probes: prompts sharing a prefix with the base at a
    known rate. From an idle start the segments rotate over the three engines, so each probe's
    two possible answers (the base's engine, the least loaded) are different engines.
    """
    def ids(n: int) -> list[int]:
        return [rng.randrange(ID_LOW, ID_HIGH) for _ in range(n)]

    def letters(n: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))

    threshold = float(params["cache_threshold"])
    t32 = f32(threshold)
    pct = round(threshold * 100)
    ops: list[Op] = []

    def segment(name: str, base: Prompt, *probes: tuple[str, Prompt, bool],
                text: bool = False) -> None:
        """Probes carry whether their token match clears the threshold."""
        near_copy = base + " x" if isinstance(base, str) else base + ids(2)
        ops.append(Op("run", base, f"{name}: base"))
        ops.append(Op("pin", near_copy, f"{name}: pin a near-copy on the base's engine"))
        ops.extend(Op("run", p, f"{name}: {what}", expect="match" if clears else "low_match",
                      granularity=text) for what, p, clears in probes)

    if int(params["balance_abs_threshold"]) <= 4:
        # From the idle start: near-copies of one prompt pile onto its engine until the fleet is
        # imbalanced (abs_threshold + 1 against 0, 0); then prompts that match it well go to
        # the least loaded engine. Once the copies end, a prompt extending the first of those
        # goes where the imbalanced branch sent it: the tree learns in both branches.
        g = ids(100)
        copies = int(params["balance_abs_threshold"]) + 1
        ops.append(Op("run", g, "imbalance: base"))
        ops.extend(Op("pin", g + ids(2), f"imbalance: near-copy {i}") for i in range(copies))
        probe = g + ids(5)
        ops.append(Op("run", probe, "imbalance: a good match, under imbalance",
                      expect="imbalanced"))
        ops.append(Op("pin", g + ids(4), "imbalance: one more near-copy, under imbalance",
                      expect="imbalanced"))
        ops.append(Op("run", g + ids(6), "imbalance: another good match, still imbalanced",
                      expect="imbalanced"))
        ops.extend(Op("unpin", pin=i, label="imbalance: a near-copy ends")
                   for i in range(copies + 1))
        ops.append(Op("run", probe + ids(5), "imbalance: extends that match, balanced again",
                      expect="match"))

    q = ids(100)  # exactly pct/100 clears the threshold only if f32(threshold) < threshold
    segment("ids", q, (f"{pct}/100 tokens", q[:pct] + ids(100 - pct), pct / 100 > t32),
            (f"{pct + 1}/100 tokens", q[:pct + 1] + ids(99 - pct), True))
    # m of n tokens stays under the threshold, m and a half would clear it; the next id differs
    # from the base's in its last digit only, so matching the ids' text encodings (decimal or
    # hex) would give that token partial credit and clear the threshold.
    n = next(n for n in range(100, 200) if (int(t32 * n) + 0.5) / n > t32)
    m = int(t32 * n)
    q = ids(n)
    near = q[m] + 1 if q[m] % 10 != 9 else q[m] - 1
    segment("ids, whole tokens", q, (f"{m}/{n} tokens, then a near id",
                                     q[:m] + [near] + ids(n - m - 1), False))
    # Sim tokens: a letter run is one token per 3 letters, " abc" one token, and a digit or a
    # 2-byte character one token per byte.
    c = pct + 5  # letters shared, then 2-byte characters: c/100 chars but few of many tokens
    base = "A" + letters(c - 1) + "\u00fc" * (100 - c)
    segment("text, letters then 2-byte chars", base,
            ("chars over, tokens under the threshold", base[:c] + "\u00f6" * (100 - c), False),
            text=True)
    k = pct - 10  # 2-byte characters shared, then letters: k/100 chars but most of the tokens
    base = "\u00fc" * k + "B" + letters(99 - k)
    segment("text, 2-byte chars then letters", base,
            ("chars under, tokens over the threshold", base[:k] + "C" + letters(99 - k), True),
            text=True)
    w = (pct + 10) // 4  # " abc" word pieces shared (4 chars, 1 token each), then digits
    base = "D" + "".join(" " + letters(3) for _ in range(w)) + "7" * (99 - 4 * w)
    probe = base[: 1 + 4 * w] + "".join(rng.choice("0123456") for _ in range(99 - 4 * w))
    segment("text, words then digits", base,
            ("chars over, tokens under the threshold", probe, False), text=True)
    # A tie: two engines have served all of `common`, so the probe's best match is on both, and
    # the busier of the two comes first in the router's order. From the loads the segments
    # above leave (2, 2, 1): the base and a pin go to the third engine, the base inside a long
    # prompt (a low match) to the first, a second pin to the first: 3, 2, 2.
    common = ids(100)
    ops.append(Op("run", common, "tie: base"))
    ops.append(Op("pin", ids(100), "tie: an unrelated pin"))
    ops.append(Op("run", common + ids(250), "tie: the base in a long prompt (a low match)",
                  expect="low_match"))
    ops.append(Op("pin", ids(100), "tie: another unrelated pin"))
    ops.append(Op("run", common + ids(3), "tie: a probe matching both equally", expect="match",
                  tie=True))
    return ops


def mixed(rng: random.Random, first_pin: int) -> list[Op]:
    """GRPO-like groups, growing conversations and one-offs, interleaved; pins come and go."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(ID_LOW, ID_HIGH) for _ in range(n)]

    actors: list[list[Op]] = []
    for g in range(4):  # a shared prompt, then samples that extend it; some stay in flight
        prompt = ids(rng.randint(60, 160))
        actors.append([Op(rng.choice(["run", "run", "pin"]), prompt + ids(rng.randint(5, 30)),
                          f"group {g} sample {s}") for s in range(rng.randint(3, 5))])
    for c in range(3):  # multi-turn: each turn's prompt is the last plus reply and user message
        history = ids(rng.randint(40, 100))
        turns = []
        for t in range(rng.randint(3, 6)):
            turns.append(Op("run", list(history), f"conversation {c} turn {t}"))
            history = history + ids(rng.randint(8, 20)) + ids(rng.randint(3, 10))
        actors.append(turns)
    for i in range(5):
        actors.append([Op(rng.choice(["run", "pin"]), ids(rng.randint(20, 200)), f"one-off {i}")])
    for i in range(2):  # text sharing a head, with tails of growing length
        head = "E" + "".join(rng.choice("abcdefgh \u00e9\u20ac") for _ in range(60))
        actors.append([Op("run", head + "".join(rng.choice("xyz \u00e8") for _ in range(m)),
                          f"text {i} + {m}") for m in (10, 40, 120)])

    ops: list[Op] = []
    open_pins: list[int] = []
    next_pin = first_pin
    while any(actors):
        op = rng.choice([a for a in actors if a]).pop(0)
        ops.append(op)
        if op.kind == "pin":
            open_pins.append(next_pin)
            next_pin += 1
        if open_pins and rng.random() < 0.15:
            ops.append(Op("unpin", pin=open_pins.pop(rng.randrange(len(open_pins))),
                          label="a pinned request ends"))
    return ops


def run_differential(params: dict[str, float | int], flags: Sequence[str],
                     seed: int) -> list[Step]:
    rng = random.Random(seed)
    ops = crafted(params, rng)
    ops += mixed(rng, first_pin=sum(op.kind == "pin" for op in ops))
    steps: list[Step] = []
    with processes() as procs:
        engines = [start_engine(procs, engine_seed) for engine_seed in (1, 2, 3)]
        router = start_router(procs, engines, *flags)
        rig = RouterRig(router, engines)
        key = render_key(engines[0])
        ours, by_chars = Model(params, key), Model(params, char_key)
        try:
            for n, op in enumerate(ops):
                if op.kind == "unpin":
                    assert op.pin is not None
                    rig.unpin(op.pin)
                    continue
                assert op.prompt is not None
                prefix, chars = key(op.prompt), char_key(op.prompt)
                loads = rig.loads()  # settled: nothing is on the move
                predicted, branch, best = ours.choose(n, prefix, loads)
                predicted_by_chars, _, _ = by_chars.choose(n, chars, loads)
                if op.kind == "pin":
                    actual = rig.pin("/v1/completions", {"prompt": op.prompt})
                else:
                    actual, _ = rig.run("/v1/completions", {"prompt": op.prompt, "max_tokens": 1,
                                                            "sim_output_len": 1})
                ours.record(prefix, actual, predicted)
                by_chars.record(chars, actual, predicted_by_chars)
                steps.append(Step(n, op, loads, actual, predicted, branch, best,
                                  least_loaded(list(loads), loads), predicted_by_chars))
        finally:
            rig.close()
    return steps


def report(steps: list[Step]) -> str:
    order = list(steps[0].loads)
    return "\n".join(
        f"{'  ' if s.router == s.ours else '!!'} #{s.n:<3} {s.op.kind:<4} {s.branch:<10} loads "
        f"{[s.loads[u] for u in order]} router w{order.index(s.router)} "
        f"ours w{order.index(s.ours)}  {s.op.label}"
        for s in steps)


CONFIGS = {
    "defaults": ({"cache_threshold": 0.3, "balance_abs_threshold": 64,
                  "balance_rel_threshold": 1.5}, ()),
    "tight": ({"cache_threshold": 0.7, "balance_abs_threshold": 2, "balance_rel_threshold": 1.5},
              ("--cache-threshold", "0.7", "--balance-abs-threshold", "2",
               "--balance-rel-threshold", "1.5")),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_cache_aware_policy_routes_as_the_real_router(config: str) -> None:
    params, flags = CONFIGS[config]
    steps = run_differential(params, flags, seed=11)
    table = report(steps)
    disagreements = [s for s in steps if s.router != s.ours]
    branches = Counter(s.branch for s in steps)
    decisive = [s for s in steps if s.router != s.least_loaded]  # not plain least-loaded
    print(f"\n[{config}]\n{table}\n[{config}] {len(steps)} requests compared, "
          f"{len(steps) - len(disagreements)} agreed; branches {dict(branches)}; "
          f"{len(decisive)} not on the least loaded engine; keyed by characters, "
          f"{sum(s.by_chars == s.router for s in steps)} agreed")
    assert not disagreements, f"our CacheAware differs from vllm-router:\n{table}"
    # The comparison means something: enough requests, every branch, answers that are not
    # plain least-loaded.
    assert len(steps) >= 40
    assert branches["match"] >= 10 and branches["low_match"] >= 5, branches
    assert len(decisive) >= 8, len(decisive)
    if config == "tight":
        assert branches["imbalanced"] >= 3, branches

    # Every crafted probe went where its token match rate says: to the base's engine if it
    # clears the threshold (and the fleet is balanced), else to the least loaded one (a
    # different engine by construction).
    probes = [s for s in steps if s.op.expect is not None]
    assert len(probes) == (12 if config == "tight" else 8)
    for s in probes:
        assert s.branch == s.op.expect, (s.op.label, s.branch)
        assert (s.router != s.least_loaded) is (s.branch == "match"), (s.op.label, s.loads)
        if s.op.tie:  # the least loaded of the best, not the first of them in order
            assert len(s.best) >= 2 and s.router == least_loaded(s.best, s.loads) != s.best[0]
        if s.op.granularity:  # a policy matching characters would have gone the other way
            assert s.by_chars != s.router, (s.op.label, s.loads, s.router)
