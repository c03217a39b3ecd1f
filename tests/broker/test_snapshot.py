"""The broker's snapshot with its `ViewCache`: the same snapshot as building it from scratch,
with unchanged heartbeats and resident sessions reused (pure: no Redis)."""

from __future__ import annotations

import random

from broker.heartbeat import EngineMetrics, HeartbeatRecord, SessionProgress
from broker.ledger import LedgerState
from broker.snapshot import FleetRead, ResidentMeta, ViewCache, build_snapshot


def beat(backend_id: str, at: float, progress: dict[str, tuple[int, int, int, bool]]) -> bytes:
    return HeartbeatRecord(
        backend_id=backend_id, at=at, sent_at=at,
        metrics=EngineMetrics(kv_usage=0.5, running=len(progress), waiting=0,
                              preemptions_total=int(at), prefix_queries_total=0,
                              prefix_hits_total=0),
        sessions=[SessionProgress(session_id=sid, context_tokens=c, generated_tokens=g, turn=t,
                                  waiting_on_tool=w) for sid, (c, g, t, w) in progress.items()],
    ).model_dump_json().encode()


def fleet_of(ledgers: dict[str, dict[str, int]], beats: dict[str, bytes | None],
             cache: ViewCache | None, versions: dict[str, int] | None = None) -> FleetRead:
    parse = cache.heartbeat if cache is not None else (
        lambda b, raw: HeartbeatRecord.model_validate_json(raw) if raw is not None else None)
    states = {b: LedgerState(backend_id=b, capacity_tokens=10_000, max_model_len=4096, alpha=1.0,
                             reserved_tokens=sum(s.values()), reserved_by_workload={},
                             sessions=dict(s),
                             version=f"e:{versions[b]}" if versions is not None else None)
              for b, s in ledgers.items()}
    return FleetRead(backend_index=tuple(sorted(ledgers)), workloads=("a", "b"), ledgers=states,
                     heartbeats={b: parse(b, beats.get(b)) for b in ledgers},
                     mixture={"a": 0.5, "b": 0.5}, consumed={})


def test_the_cached_snapshot_equals_one_built_from_scratch_as_the_fleet_changes():
    """Ledgers carry versions that move with every change of their sessions (as the scripts
    bump them), so whole views are reused; metadata sometimes arrives a round late."""
    rng = random.Random(7)
    backends = [f"b{i}" for i in range(4)]
    ledgers: dict[str, dict[str, int]] = {b: {} for b in backends}
    versions = dict.fromkeys(backends, 0)
    progress: dict[str, dict[str, tuple[int, int, int, bool]]] = {b: {} for b in backends}
    meta: dict[str, ResidentMeta] = {}
    late: dict[str, ResidentMeta] = {}
    cache = ViewCache()
    next_id = 0
    reused = 0
    last = None
    for step in range(400):
        meta.update(late)  # the broker loaded what it had not read yet
        late = {}
        b = rng.choice(backends)
        move = rng.random()
        if move < 0.3 or not ledgers[b]:  # admit
            sid = f"s{next_id}"
            next_id += 1
            ledgers[b][sid] = rng.randint(100, 900)
            m = ResidentMeta(workload=rng.choice("ab"), group_id=None,
                             prompt_tokens=rng.randint(10, 99), max_tokens=1000,
                             max_turns=rng.choice((1, 3)), admitted_at=float(step))
            (late if rng.random() < 0.2 else meta)[sid] = m
            versions[b] += 1
        else:
            sid = rng.choice(sorted(ledgers[b]))
            if move < 0.45:  # finish
                del ledgers[b][sid]
                progress[b].pop(sid, None)
                versions[b] += 1
            elif move < 0.6:  # recharge
                ledgers[b][sid] = rng.randint(100, 900)
                versions[b] += 1
            elif move < 0.85:  # progress in the next heartbeat
                c, g, t, w = progress[b].get(sid, (50, 0, 0, False))
                progress[b][sid] = (c + 5, g + 5, t + rng.choice((0, 0, 1)), rng.random() < 0.2)
            elif move < 0.9 and sid in meta:  # requeued and admitted again, same charge
                m = meta[sid]
                meta[sid] = ResidentMeta(workload=m.workload, group_id=m.group_id,
                                         prompt_tokens=m.prompt_tokens + 7,
                                         max_tokens=m.max_tokens, max_turns=m.max_turns,
                                         admitted_at=m.admitted_at + 0.5)
                versions[b] += 2
        beats = {x: beat(x, float(step // 5), progress[x]) for x in backends}
        if step % 17 == 0:
            beats[rng.choice(backends)] = None  # a heartbeat gone
        cached = build_snapshot(1.0, {}, fleet_of(ledgers, beats, cache, versions), meta,
                                cache=cache)
        fresh = build_snapshot(1.0, {}, fleet_of(ledgers, beats, None), meta)
        assert cached == fresh, f"step {step}"
        if last is not None:
            reused += sum(v is w for v, w in zip(cached.backends, last.backends))
        last = cached
    assert reused > 200  # whole views were reused (4 backends, ~1 changing per step)


def test_an_unchanged_resident_keeps_its_view_and_a_changed_one_gets_a_new_one():
    cache = ViewCache()
    meta = {sid: ResidentMeta(workload="a", group_id=None, prompt_tokens=10, max_tokens=100,
                              max_turns=1, admitted_at=0.0) for sid in ("x", "y", "z")}
    ledgers = {"b0": {"x": 100, "y": 200, "z": 300}}
    raw = beat("b0", 1.0, {"x": (20, 10, 1, False), "y": (15, 5, 1, False)})
    first = build_snapshot(1.0, {}, fleet_of(ledgers, {"b0": raw}, cache), meta, cache=cache)
    ledgers["b0"]["z"] = 350  # recharged
    raw2 = beat("b0", 2.0, {"x": (20, 10, 1, False), "y": (16, 6, 1, False)})  # y moved
    second = build_snapshot(2.0, {}, fleet_of(ledgers, {"b0": raw2}, cache), meta, cache=cache)
    before = {s.session_id: s for s in first.backends[0].sessions}
    after = {s.session_id: s for s in second.backends[0].sessions}
    assert after["x"] is before["x"]
    assert after["y"] is not before["y"] and after["y"].generated_tokens == 6
    assert after["z"] is not before["z"] and after["z"].reserved_tokens == 350


def test_a_heartbeat_is_parsed_again_only_when_its_bytes_change():
    cache = ViewCache()
    raw = beat("b0", 1.0, {"x": (20, 10, 1, False)})
    one = cache.heartbeat("b0", raw)
    assert cache.heartbeat("b0", bytes(raw)) is one
    changed = cache.heartbeat("b0", beat("b0", 2.0, {"x": (21, 11, 1, False)}))
    assert changed is not one and changed is not None and changed.at == 2.0
    assert cache.heartbeat("b0", None) is None
    assert cache.heartbeat("b0", b"not json") is None
