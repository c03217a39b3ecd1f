"""A fault-injecting TCP proxy: network faults between two processes, not process faults.

Put it between a process and what it talks to (Redis, an engine) by giving the process the
proxy's address; then, while traffic flows:

- `set_latency(s, jitter_s)`: every chunk is held `s` ± `jitter_s` seconds each way (order is
  kept: a chunk never overtakes the one before it);
- `reset()`: every open connection is closed with a TCP RST (SO_LINGER 0), as a middlebox that
  drops its state does; new connections work;
- `lose_reply(containing)`: the next reply chunk (upstream to client) holding those bytes is
  dropped and its connection reset: the request ran upstream, its answer never arrived. A
  client that sends the request again on a new connection runs it twice;
- `blackhole(True)`: nothing is delivered either way, on open connections and on new ones
  (they are accepted, then nothing); no connection is closed. A connection that stops
  answering without closing. What was sent meanwhile is delivered when it ends, as TCP's
  retransmissions would once the path heals; `blackhole(False)` ends it. A partition of the
  process is a blackhole on every proxy in front of it.

It runs its own event loop in a daemon thread; the methods are thread-safe. Used by
`benchmarks/chaos.py` (the `net-*` faults) and `tests/test_netfault.py`.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from dataclasses import dataclass, field


@dataclass
class _State:
    latency_s: float = 0.0
    jitter_s: float = 0.0
    healed: asyncio.Event = field(default_factory=asyncio.Event)  # set unless blackholed
    lose: bytes | None = None  # the next reply chunk holding these bytes is lost
    lost: int = 0  # replies lost so far


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, listen_port: int = 0,
                 seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._state: _State | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy",
                                        daemon=True)
        self._thread.start()
        self.port = self._call(self._start(listen_port))

    # -- control (any thread) -------------------------------------------------------------------
    def set_latency(self, latency_s: float, jitter_s: float = 0.0) -> None:
        def apply() -> None:
            self._state.latency_s, self._state.jitter_s = latency_s, jitter_s
        self._loop.call_soon_threadsafe(apply)

    def blackhole(self, on: bool) -> None:
        def apply() -> None:
            (self._state.healed.clear if on else self._state.healed.set)()
        self._loop.call_soon_threadsafe(apply)

    def lose_reply(self, containing: bytes) -> None:
        async def arm() -> None:  # (in force when this returns)
            self._state.lose = containing
        self._call(arm())

    @property
    def lost_replies(self) -> int:
        return self._state.lost

    def reset(self) -> int:
        """RST every open connection; returns how many."""
        async def go() -> int:
            writers = list(self._writers)
            for w in writers:
                _abort(w)
            return len(writers)
        return self._call(go())

    def close(self) -> None:
        async def go() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                _abort(w)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._call(go())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    @property
    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- the proxy (its loop) -------------------------------------------------------------------
    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self, port: int) -> int:
        self._state = _State()
        self._state.healed.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        try:
            await self._state.healed.wait()  # a new connection in a blackhole gets nothing
            try:
                up_r, up_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                _abort(client_w)  # upstream refused: so does the proxy
                return
            self._writers.add(up_w)
            try:
                await asyncio.gather(self._pipe(client_r, up_w),
                                     self._pipe(up_r, client_w, replies=True))
            finally:
                self._writers.discard(up_w)
                up_w.close()
        finally:
            self._writers.discard(client_w)
            client_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    replies: bool = False) -> None:
        """Copy one direction (`replies`: upstream to client), chunk by chunk, delayed, held
        and lost as the faults say; at EOF or an error on either side, close the other side
        too."""
        state = self._state
        due = 0.0  # when the previous chunk went out: order is kept
        try:
            while chunk := await reader.read(65536):
                delay = state.latency_s + (self._rng.uniform(-1, 1) * state.jitter_s
                                           if state.jitter_s else 0.0)
                loop = asyncio.get_running_loop()
                due = max(due, loop.time() + max(0.0, delay))
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await state.healed.wait()
                if replies and state.lose is not None and state.lose in chunk:
                    state.lose = None
                    state.lost += 1
                    _abort(writer)
                    return
                writer.write(chunk)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()  # half-close: the other direction goes on
            else:
                writer.close()
        except (ConnectionError, OSError):
            _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
