"""LoRA adapters on the worker's engine: loaded on demand, through vLLM's own API.

A session that names an adapter (`Session.adapter`) runs every request with vLLM's `model` set
to the adapter's name. Before its first request the worker makes sure its engine has the
adapter at the version the namespace registered (broker/adapters.py): `POST
/v1/load_lora_adapter {lora_name, lora_path}` the first time, with `load_inplace` when the
namespace registered new weights since. The engine must run with `--enable-lora` (and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which `workers/engine.py` sets for engines it starts);
`--max-loras` (the adapters one step may mix) is read with the rest of the engine's info
(`workers.engine.read_engine_info`) and registered, so the broker places an adapter's sessions
only where a slot is free or already holds it.

The worker keeps at most `cache` adapters loaded (default: `max_loras`, which is vLLM's
default `--max-cpu-loras`, its CPU cache of adapters) and unloads the least recently used one
that no running session uses to make room. The loaded set goes out with every heartbeat: the
broker prefers an engine that has a session's adapter already.

On an engine several namespaces share (broker/shares.py) each namespace has its own
`AdapterLoader` over the engine's one `EngineAdapters` (the cache and its order), and loads its
adapters under `<namespace>/<name>`: two jobs may name different adapters alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import httpx

from broker.adapters import AdapterRecord
from workers.runner import EngineError, EngineUnavailable

log = logging.getLogger("rollout_broker.worker")

class AdapterError(EngineError):
    """The session's adapter cannot be used (not registered, or the engine refused its files):
    the session's fault, so it ends failed with the message."""


class EngineAdapters:
    """The adapters loaded into one engine, by their names there, least recently used first,
    and how many running sessions use each. One per engine, whichever namespaces it serves."""

    def __init__(self, cache: int) -> None:
        if cache < 1:
            raise ValueError(f"cache: {cache} must be at least 1 adapter")
        self.cache = cache
        self.loaded: OrderedDict[str, int] = OrderedDict()  # engine name -> version, LRU first
        # What the heartbeat threads read: set anew (never changed in place) on every change.
        self.names: tuple[str, ...] = ()
        self.in_use: frozenset[str] = frozenset()
        self._users: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def hold(self, name: str) -> None:
        self._users[name] = self._users.get(name, 0) + 1
        self.in_use = frozenset(self._users)

    def release(self, name: str) -> None:
        left = self._users.get(name, 0) - 1
        if left > 0:
            self._users[name] = left
        else:
            self._users.pop(name, None)
        self.in_use = frozenset(self._users)

    def held(self, name: str) -> bool:
        return bool(self._users.get(name))

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def set_loaded(self, name: str, version: int | None) -> None:
        """Record `name` loaded at `version` (most recently used), or gone (None)."""
        if version is None:
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = version
            self.loaded.move_to_end(name)
        self.names = tuple(self.loaded)


class AdapterLoader:
    """One namespace's adapters on its worker's engine: loaded on demand, by the versions the
    namespace registered; `scope` is the prefix of their names in the engine ('' when the
    engine serves this namespace alone)."""

    def __init__(self, http: httpx.AsyncClient, engine_url: str,
                 lookup: Callable[[str], Awaitable[AdapterRecord | None]],
                 engine: EngineAdapters, scope: str = "", timeout_s: float = 120.0) -> None:
        self.http = http
        self.base = engine_url.rstrip("/")
        self.lookup = lookup
        self.engine = engine
        self.scope = scope
        self.timeout_s = timeout_s
        self._open: dict[str, asyncio.Event] = {}  # adapter -> set while not paused

    def pause(self, name: str) -> None:
        """An adapter-only weight update of `name` (broker/weights.py): sessions that start
        from now on wait in `acquire` until `resume`."""
        self._open.setdefault(name, asyncio.Event()).clear()

    def resume(self, name: str) -> None:
        event = self._open.pop(name, None)
        if event is not None:
            event.set()

    def serves(self, name: str) -> bool:
        """Whether the engine has `name` loaded, or a running session uses it."""
        e = self.engine_name(name)
        return e in self.engine.loaded or self.engine.held(e)

    def engine_name(self, name: str) -> str:
        """The name the engine knows adapter `name` by (what requests give as `model`)."""
        return self.scope + name

    @property
    def names(self) -> tuple[str, ...]:
        """This namespace's adapters loaded in the engine (safe to read from another thread)."""
        n = len(self.scope)
        return tuple(e[n:] for e in self.engine.names if e.startswith(self.scope))

    def in_use(self) -> frozenset[str]:
        """The engine names of this namespace's adapters that running sessions use."""
        return frozenset(e for e in self.engine.in_use if e.startswith(self.scope))

    async def acquire(self, name: str) -> None:
        """Make sure the engine has `name` at its registered version, and hold it loaded
        until `release` (first waiting out a pause of `name`). Raises AdapterError naming the
        adapter."""
        while (paused := self._open.get(name)) is not None:
            await paused.wait()
        self.engine.hold(self.engine_name(name))
        try:
            await self._ensure(name)
        except BaseException:
            self.release(name)
            raise

    def release(self, name: str) -> None:
        self.engine.release(self.engine_name(name))

    async def refresh(self, name: str) -> None:
        """Load `name`'s registered weights now if the engine has another version (a paused
        adapter's new weights, before its engine resumes)."""
        self.engine.hold(self.engine_name(name))
        try:
            await self._ensure(name)
        finally:
            self.release(name)

    def forget(self, name: str) -> None:
        """The engine no longer has `name` (it answered 404 for it: restarted); load it again
        on the next `acquire`."""
        self.engine.set_loaded(self.engine_name(name), None)

    async def _ensure(self, name: str) -> None:
        engine_name = self.engine_name(name)
        async with self.engine.lock(engine_name):
            record = await self.lookup(name)
            if record is None:
                raise AdapterError(f"adapter: {name!r} is not registered in this namespace")
            have = self.engine.loaded.get(engine_name)
            if have == record.version:
                self.engine.set_loaded(engine_name, have)
                return
            await self._make_room(engine_name)
            await self._load(engine_name, record, in_place=have is not None)
            self.engine.set_loaded(engine_name, record.version)

    async def _load(self, engine_name: str, record: AdapterRecord, in_place: bool) -> None:
        body = {"lora_name": engine_name, "lora_path": record.path, "load_inplace": in_place}
        r = await self._post("/v1/load_lora_adapter", body)
        if r.status_code == 400 and "already been loaded" in r.text and not in_place:
            # Loaded by this engine before this worker knew (a restarted worker): the
            # registered weights go in over it.
            r = await self._post("/v1/load_lora_adapter", {**body, "load_inplace": True})
        if r.status_code >= 400:
            raise AdapterError(f"adapter: {record.name!r} from {record.path}: the engine "
                               f"refused it (HTTP {r.status_code}: {r.text[:300]})")
        log.info("adapter %s: loaded version %d from %s", engine_name, record.version,
                 record.path)

    async def _make_room(self, engine_name: str) -> None:
        """Unload least recently used adapters (of any namespace) no running session holds,
        down to `cache` - 1 besides `engine_name` (an adapter all of whose slots are in use
        stays: vLLM pages adapters itself, so more loaded than the cache costs memory, not
        correctness)."""
        engine = self.engine
        if engine_name in engine.loaded:
            return
        for old in list(engine.loaded):
            if len(engine.loaded) < engine.cache:
                return
            if engine.held(old):
                continue
            r = await self._post("/v1/unload_lora_adapter", {"lora_name": old})
            if r.status_code < 400 or r.status_code == 404:
                engine.set_loaded(old, None)

    async def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            return await self.http.post(self.base + path, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:  # the engine's fault: the session is handed back
            raise EngineUnavailable(f"engine: {path} for adapter {body['lora_name']!r} "
                                    f"failed: {type(exc).__name__}: {exc}") from exc
