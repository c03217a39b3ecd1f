"""The KV ledger: per backend, what is reserved against α·C, and per workload KV·seconds.

Fields of `rb:{ns}:ledger:<b>` (a hash), who writes them, and what they mean:
- `capacity`      C_b in KV tokens (num_gpu_blocks × block_size); written by the backend's
                  worker when it registers.
- `max_model_len` the engine's context limit; written at registration.
- `vocab_size`    the engine's vocabulary (token ids must be below it); written at registration
                  when the worker knows it.
- `engine_url`, `model`  where the backend's engine answers vLLM's HTTP API for the session
                  gateway (the worker's `--advertise-url`, by default its engine's URL) and the
                  model it serves; written at registration.
- `max_loras`     how many LoRA adapters the engine mixes in one step (vLLM's `--max-loras`;
                  absent: LoRA off); written at registration.
- `alpha`         α_b: reservations may reach α_b·C_b; set to 1.0 at first registration, then
                  written only by the active broker from `Decision.alpha`.
- `reserved`      Σ of the per-session reservations in `ledger:<b>:sessions`; changed only by the
                  admit / finish / cancel / reclaim / recharge scripts, always together with them.
- `w:<workload>`  the part of `reserved` held by sessions of that workload.
- `ver`, `epoch`  `ver` counts the changes of `ledger:<b>:sessions` (every script that changes
                  it bumps it in the same step); `epoch` is random, set when the ledger is first
                  registered. Together (`ledger_version`) they let the broker keep a backend's
                  sessions between reads and read them again only when they changed.
Admission keeps `reserved ≤ floor(α·C)`; lowering α never evicts anyone, so after a decrease
`reserved` may sit above the new limit until sessions finish.
`rb:{ns}:kvsec` sums, per workload, the KV-token-seconds of finished sessions (`n:<w>` counts).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from broker.keys import WORKERS_GROUP, Keys, check_backend_id
from broker.plans import Cmd, Plan, batch, cmd
from broker.streams import as_text, ensure_group


@dataclass(frozen=True, slots=True)
class LedgerState:
    backend_id: str
    capacity_tokens: int
    max_model_len: int
    alpha: float
    reserved_tokens: int
    reserved_by_workload: dict[str, int]
    sessions: dict[str, int]  # session_id -> reserved tokens
    version: str | None = None  # changes whenever `sessions` does (ledger_version)
    model: str | None = None  # the model its engine serves
    max_loras: int = 0  # LoRA adapters one engine step may mix; 0: LoRA off

    @property
    def limit_tokens(self) -> int:
        return int(self.alpha * self.capacity_tokens)


@dataclass(frozen=True, slots=True)
class EnqueueLimits:
    """What the registered backends allow a session; None where no backend has said yet."""

    max_model_len: int | None = None  # the largest context limit: a prompt must fit one backend
    vocab_size: int | None = None  # the smallest vocabulary: a session may land on any backend
    capacity_tokens: int | None = None  # the largest KV cache: a session must fit one backend
    models: frozenset[str] = frozenset()  # the models registered backends serve
    lora: bool = False  # some registered backend serves LoRA adapters
    adapters: frozenset[str] | None = None  # the namespace's registered LoRA adapters


def parse_ledger(backend_id: str, fields: dict, sessions: dict) -> LedgerState | None:
    """A ledger from its two hashes as HGETALL returns them; None when never registered."""
    f = ledger_fields(fields)
    if f is None:
        return None
    return ledger_state(backend_id, f, {as_text(k): int(v) for k, v in sessions.items()})


def ledger_fields(fields: Mapping) -> dict[str, str] | None:
    """The ledger hash as text; None when the backend never registered."""
    f = {as_text(k): as_text(v) for k, v in fields.items()}
    return f if "capacity" in f else None


def ledger_state(backend_id: str, f: Mapping[str, str], sessions: dict[str, int]) -> LedgerState:
    """The ledger from its hash (`ledger_fields`) and its sessions, already read."""
    return LedgerState(
        backend_id=backend_id,
        capacity_tokens=int(f["capacity"]),
        max_model_len=int(f.get("max_model_len", 0)),
        alpha=float(f.get("alpha", 1.0)),
        reserved_tokens=int(f.get("reserved", 0)),
        reserved_by_workload={k[2:]: int(v) for k, v in f.items() if k.startswith("w:")},
        sessions=sessions,
        version=ledger_version(f),
        model=f.get("model"),
        max_loras=int(f.get("max_loras", 0)),
    )


def ledger_version(fields: Mapping[str, str]) -> str | None:
    """What identifies the content of a ledger's sessions hash (epoch and change count), or
    None for a ledger written before epochs existed (then nothing may be cached by it)."""
    epoch = fields.get("epoch")
    return f"{epoch}:{fields.get('ver', '0')}" if epoch else None


class Ledger:
    """Typed access to the ledger hashes. Holds a client; pass `pipe` to batch writes."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys

    def register_backend(self, backend_id: str, capacity_tokens: int, max_model_len: int,
                         vocab_size: int | None = None, engine_url: str | None = None,
                         model: str | None = None, max_loras: int = 0) -> None:
        """Create or update a backend's ledger, index it, and make its admitted stream's group."""
        check_backend_id(backend_id)
        if max_loras < 0:
            raise ValueError(f"max_loras: {max_loras} must be 0 (LoRA off) or more")
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens: {capacity_tokens} must be positive")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len: {max_model_len} must be positive")
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size: {vocab_size} must be positive")
        k = self._keys
        pipe = self._client.pipeline(transaction=True)
        fields = {"capacity": capacity_tokens, "max_model_len": max_model_len}
        if vocab_size is not None:
            fields["vocab_size"] = vocab_size
        else:
            pipe.hdel(k.ledger(backend_id), "vocab_size")
        for name, value in (("engine_url", engine_url), ("model", model),
                            ("max_loras", max_loras)):
            if value:
                fields[name] = value
            else:
                pipe.hdel(k.ledger(backend_id), name)
        pipe.hset(k.ledger(backend_id), mapping=fields)
        pipe.hsetnx(k.ledger(backend_id), "alpha", 1.0)
        pipe.hsetnx(k.ledger(backend_id), "reserved", 0)
        # With 'ver' (bumped by every script that changes the sessions hash), what a reader
        # may cache the sessions by: a ledger created again gets a new epoch.
        pipe.hsetnx(k.ledger(backend_id), "epoch", uuid.uuid4().hex[:12])
        pipe.sadd(k.backends, backend_id)
        pipe.execute()
        ensure_group(self._client, k.admitted(backend_id), WORKERS_GROUP)

    def read(self, backend_id: str) -> LedgerState | None:
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(self._keys.ledger(backend_id))
        pipe.hgetall(self._keys.ledger_sessions(backend_id))
        fields, sessions = pipe.execute()
        return parse_ledger(backend_id, fields, sessions)

    def set_alpha(self, backend_id: str, alpha: float, pipe: redis.client.Pipeline | None = None) -> None:
        if not (alpha > 0.0):
            raise ValueError(f"alpha: {alpha} must be positive")
        (pipe or self._client).hset(self._keys.ledger(backend_id), "alpha", repr(float(alpha)))

    def kv_seconds(self) -> dict[str, tuple[float, int]]:
        """workload -> (summed KV-token-seconds, finished sessions). The hash's other fields
        (`n:`, `tok:`, `failed:` + workload; finish.lua) are per-workload counters."""
        raw = {as_text(k): as_text(v) for k, v in self._client.hgetall(self._keys.kv_seconds).items()}
        return {w: (float(v), int(raw.get(f"n:{w}", 0))) for w, v in raw.items() if ":" not in w}


def read_all(keys: Keys) -> Plan[dict[str, LedgerState]]:
    """Every registered backend's ledger, read in one transaction."""
    ids = sorted(as_text(b) for b in (yield cmd("smembers", keys.backends)))
    replies = yield batch([Cmd("hgetall", (key,)) for b in ids
                           for key in (keys.ledger(b), keys.ledger_sessions(b))],
                          transaction=True)
    out = {}
    for i, b in enumerate(ids):
        state = parse_ledger(b, replies[2 * i], replies[2 * i + 1])
        if state is not None:
            out[b] = state
    return out


def enqueue_limits(keys: Keys) -> Plan[EnqueueLimits]:
    """The registered backends' context and vocabulary limits.

    Three fields per backend, not `read_all`: every enqueue asks, and the per-session
    reservations of the whole fleet are not needed for it."""
    ids = sorted(as_text(b) for b in (yield cmd("smembers", keys.backends)))
    replies = yield batch([Cmd("hmget", (keys.ledger(b), "capacity", "max_model_len",
                                         "vocab_size", "model", "max_loras")) for b in ids])
    rows = [(int(cap), int(m or 0), int(v) if v else None)
            for cap, m, v, _, _ in replies if cap is not None]
    vocabs = [v for _, _, v in rows if v is not None]
    served = [r for r in replies if r[0] is not None]
    adapters = yield cmd("hgetall", keys.adapters)  # (the ACL grants hgetall, not hkeys)
    return EnqueueLimits(max_model_len=max((m for _, m, _ in rows), default=None),
                         vocab_size=min(vocabs, default=None),
                         capacity_tokens=max((c for c, _, _ in rows), default=None),
                         models=frozenset(as_text(r[3]) for r in served if r[3]),
                         lora=any(r[4] and int(r[4]) > 0 for r in served),
                         adapters=frozenset(as_text(a) for a in adapters))
