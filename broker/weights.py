"""Weight updates while rollouts run: the shared state of a pause and the calls on it.

A trainer that wants to load new weights calls `pause(mode)`: the broker stops admitting,
every worker pauses its engine with vLLM's `POST /pause?mode=` (`abort`: in-flight requests end
at once and their sessions resume from what they generated; `wait`: they finish first; `keep`:
they freeze in the engine and go on after the resume) and acknowledges; `pause` returns once
every live worker has. The trainer then loads weights into the engines by its own means and
calls `resume(version)`: workers resume their engines, outputs from then on carry `version`,
and admission restarts.

Staleness (`set_max_staleness(k)`): a pending session whose `policy_version` is more than k
behind the version the engines serve is not admitted: it ends failed (`on_stale="fail"`, the
default) or runs on the current weights (`on_stale="refresh"`); a result whose oldest tokens
are more than k versions old when the trainer reads it is delivered with `stale=True`, never
as fresh.

The calls are plans (broker/plans.py): both clients run them.

An adapter-only update (`pause_adapter(name)`, new weights registered with
`register_adapter(name, path)`, `resume_adapter(name)`) pauses only what serves that LoRA
adapter: the broker holds the adapter's pending sessions, every worker holds the adapter's new
requests, and a worker whose engine has the adapter loaded pauses that engine (vLLM pauses a
whole engine) and, on the resume, loads the new weights in place before it resumes. Engines
without the adapter, and the other adapters' sessions elsewhere, run on throughout.

State lives in the namespace's `weights` hash and `control` stream (written together by
`lua/weights.lua`); acknowledgements in `paused_acks` (backend -> pause epoch), each announced
on the `paused_events` stream that `pause` blocks on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from broker.keys import Keys
from broker.plans import Cmd, Plan, batch, cmd, script
from broker.session import check_adapter_name
from broker.streams import as_text

PAUSE_MODES = ("abort", "wait", "keep")
PAUSED_EVENTS_MAXLEN = 1000  # (approximate) entries kept on `paused_events`


@dataclass(frozen=True, slots=True)
class WeightsState:
    paused: str  # the pause mode in force, '' while generating
    epoch: int  # pauses so far; a worker acknowledges the epoch its engine reached
    version: int | None  # the policy version the engines serve (None: never resumed on one)
    control_id: str  # the latest control-stream entry ('0' before any)
    max_staleness: int | None = None  # the staleness bound (None: unbounded)
    # LoRA adapters paused for an adapter-only update: name -> (mode, epoch)
    paused_adapters: Mapping[str, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, fields: Mapping) -> WeightsState:
        f = {as_text(k): as_text(v) for k, v in fields.items()}
        version, bound = f.get("version"), f.get("max_staleness")
        adapters = {}
        for k, v in f.items():
            if k.startswith("adapter_pause:"):
                mode, _, epoch = v.partition(" ")
                adapters[k[len("adapter_pause:"):]] = (mode, int(epoch or 0))
        return cls(paused=f.get("paused", ""), epoch=int(f.get("epoch") or 0),
                   version=int(version) if version else None,
                   control_id=f.get("control_id") or "0",
                   max_staleness=int(bound) if bound else None, paused_adapters=adapters)

    def is_stale(self, oldest_version: int) -> bool:
        """Whether data of `oldest_version` is more than the bound behind the version served."""
        return (self.max_staleness is not None and self.version is not None
                and self.version - oldest_version > self.max_staleness)


NOT_UPDATED = WeightsState.from_hash({})  # a namespace whose weights were never paused or set


def check_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: must be a non-negative integer, got {version!r}")
    return version


def check_staleness(max_staleness: int | None) -> int | None:
    if max_staleness is not None and (isinstance(max_staleness, bool)
                                      or not isinstance(max_staleness, int)
                                      or max_staleness < 0):
        raise ValueError("max_staleness: must be a non-negative integer or None (no bound), "
                         f"got {max_staleness!r}")
    return max_staleness


def order_staleness(keys: Keys, max_staleness: int | None) -> Plan[None]:
    check_staleness(max_staleness)
    yield script("weights", [keys.weights, keys.control, keys.events],
                 ["staleness", "" if max_staleness is None else max_staleness])


def read_state(keys: Keys) -> Plan[WeightsState]:
    return WeightsState.from_hash((yield cmd("hgetall", keys.weights)))


def order_pause(keys: Keys, mode: str) -> Plan[int]:
    """Record the pause and tell the workers; returns its epoch (the one in force if already
    paused)."""
    check_mode(mode)
    return int((yield script("weights", [keys.weights, keys.control, keys.events],
                             ["pause", mode])))


def order_pause_adapter(keys: Keys, name: str, mode: str) -> Plan[int]:
    """Record a pause of LoRA adapter `name` (registered in the namespace) and tell the
    workers; returns its epoch (the one in force if it is paused already)."""
    check_mode(mode)
    check_adapter_name(name, "adapter")
    if (yield cmd("hget", keys.adapters, name)) is None:
        raise ValueError(f"adapter: {name!r} is not registered in this namespace; register it "
                         "with RolloutClient.register_adapter(name, path)")
    return int((yield script("weights", [keys.weights, keys.control, keys.events],
                             ["pause_adapter", mode, name])))


def order_resume_adapter(keys: Keys, name: str) -> Plan[bool]:
    """End adapter `name`'s pause; False when it was not paused."""
    check_adapter_name(name, "adapter")
    return bool(int((yield script("weights", [keys.weights, keys.control, keys.events],
                                  ["resume_adapter", name]))))


def order_resume(keys: Keys, version: int) -> Plan[int]:
    check_version(version)
    return int((yield script("weights", [keys.weights, keys.control, keys.events],
                             ["resume", version])))


def live_backends(keys: Keys) -> Plan[list[str]]:
    """Backends whose worker beats now (its heartbeat key has not expired)."""
    ids = sorted(as_text(b) for b in (yield cmd("smembers", keys.backends)))
    alive = yield batch([Cmd("exists", (keys.heartbeat(b),)) for b in ids])
    return [b for b, up in zip(ids, alive) if up]


def wait_paused(keys: Keys, epoch: int, timeout_s: float,
                recheck_s: float = 0.25) -> Plan[list[str]]:
    """Until every live worker has acknowledged `epoch` (its engine is paused); returns those
    backends. Raises TimeoutError naming the ones that did not.

    It reads `paused_acks` and the live workers once, then blocks on `paused_events` (each
    ack adds an entry naming its backend and epoch) from the last entry seen before that read,
    so an ack landing in between wakes it at once, and keeps count from the entries. Both are
    read again once the workers it knows of have all acknowledged (one may have joined
    meanwhile) and whenever `recheck_s` passes without an entry (one may have died, or
    acknowledged without an entry: a worker of an earlier version)."""
    deadline = time.monotonic() + timeout_s
    last = yield cmd("xrevrange", keys.paused_events, "+", "-", count=1)
    after = as_text(last[0][0]) if last else "0-0"
    live, acks = yield from _live_and_acks(keys)
    current = True  # live and acks as just read, not counted on from entries since
    while True:
        missing = [b for b in live if acks.get(b, 0) < epoch]
        if not missing:
            if current:
                return live
            live, acks = yield from _live_and_acks(keys)  # one may have joined meanwhile
            current = True
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"pause: engines of {', '.join(missing)} not paused after "
                               f"{timeout_s:g}s")
        block_ms = max(1, int(1000 * min(recheck_s, left)))
        read = yield cmd("xread", {keys.paused_events: after}, count=1000, block=block_ms)
        entries = [e for _, es in read or () for e in es]
        for entry_id, fields in entries:
            after = as_text(entry_id)
            f = {as_text(k): as_text(v) for k, v in fields.items()}
            if f.get("backend") and f.get("epoch", "").isdigit():
                acks[f["backend"]] = max(acks.get(f["backend"], 0), int(f["epoch"]))
                current = False
        if not entries:
            live, acks = yield from _live_and_acks(keys)
            current = True


def _live_and_acks(keys: Keys) -> Plan[tuple[list[str], dict[str, int]]]:
    live = yield from live_backends(keys)
    acks = yield cmd("hgetall", keys.paused_acks)
    return live, {as_text(b): int(v) for b, v in acks.items()}
