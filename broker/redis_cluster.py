"""Redis Cluster clients, for `redis+cluster://` URLs (`broker.redis_conn.connect` makes them).

    redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?option=value&...]

(`rediss+cluster://` for TLS; port 6379 by default). The hosts are where the client starts
looking: any one that answers gives it the whole cluster's map. The query may carry redis-py's
connection options (`CLUSTER_OPTIONS`) and `broker.redis_conn`'s own parameters.

Every key of a namespace carries the `{<namespace>}` hash tag (broker/keys.py), so a namespace
is one slot on one shard: every Lua script, MULTI/EXEC and multi-stream read touches one slot,
and namespaces (RL jobs) spread over the shards. The clients are redis-py's `RedisCluster`
(blocking and asyncio) with these changes, so the rest of the code uses them as a plain client:

- Lua scripts run in pipelines: redis-py refuses EVALSHA in a cluster pipeline; here it is
  queued as any keyed command, and the registered scripts are loaded on every primary before
  a pipeline first sends one (a plain pipeline checks SCRIPT EXISTS itself), and again after a
  NOSCRIPT (a primary restarted or took over), which is raised as the outage it is, so the
  caller's retry finds the scripts there.
- MULTI/EXEC (on one slot) answers as on a plain client. redis-py 8.1's blocking cluster
  transaction leaves the replies as the server sent them; its asyncio one finds each queued
  command's slot on a new thread running its own event loop (which breaks a client that has
  not connected yet) and hands its parsers an argument some refuse.
- "The cluster cannot be reached", CLUSTERDOWN and an uncovered slot are raised as
  `ClusterUnavailable`, a ConnectionError: an outage the loops wait out (broker/redis_conn.py),
  not a crash. (Keys of two slots in one command stay a `RedisClusterException`: a bug.)
- The blocking client connects on first use, not when made (as a plain client), so a process
  started before its cluster answers waits for it like for any outage.
- XREAD/XREADGROUP find their streams in the command (after STREAMS) instead of asking a node
  (COMMAND GETKEYS) before every read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    SlotNotCoveredError,
)

# redis-py 8.2 raises its own subclass when no node answers a topology refresh; earlier ones
# a plain RedisClusterException with the same words.
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = tuple(
    e for e in (getattr(redis.exceptions, "RedisClusterUnreachableError", None),) if e)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
# Connection options a cluster URL may set (both cluster clients take them).
CLUSTER_OPTIONS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive",
                   "socket_read_size", "max_connections", "health_check_interval",
                   "ssl_check_hostname")


class ClusterUnavailable(redis.ConnectionError):
    """The cluster (or the shard serving a slot) does not answer: an outage, waited out."""


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """A cluster URL read once: where to start, the clients' options, and the query
    parameters that are not connection options (for `broker.redis_conn` to read)."""

    nodes: tuple[tuple[str, int], ...]
    options: dict[str, Any] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def _port(host: str, raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"cluster node {host} port: {raw!r} must be a number from 1 to 65535")
    return port


def address_list(netloc: str, default_port: int, what: str,
                 port_of: Callable[[str, str], int]) -> tuple[tuple[str, int], ...]:
    """`host[:port],[ipv6]:port,...` as (host, port) pairs; `port_of(host, raw)` reads a port
    (cluster nodes here, sentinels in broker.redis_conn)."""
    out = []
    for part in netloc.split(","):
        host, port = part.strip(), str(default_port)
        if host.startswith("["):  # [IPv6]:port
            host, _, rest = host[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif ":" in host:
            host, _, port = host.rpartition(":")
        if not host:
            raise ValueError(f"{what} {part.strip()!r} has no host")
        out.append((host, port_of(host, port)))
    return tuple(out)


def parse_cluster_url(url: str, own_params: tuple[str, ...] = ()) -> ClusterTarget:
    """Read a `redis+cluster://` URL (see the module docstring). `own_params` are query
    parameters the caller reads itself (returned in `params`). Raises ValueError saying what
    is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"a cluster URL starts with {' or '.join(CLUSTER_SCHEMES)}://")
    userinfo, _, netloc = parts.netloc.rpartition("@")
    if not netloc:
        raise ValueError("no cluster node address (redis+cluster://host:6379,host:6379)")
    options: dict[str, Any] = {}
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("a cluster has database 0 only: no path, or /0")
    user, _, password = userinfo.partition(":")
    if user:
        options["username"] = unquote(user)
    if password:
        options["password"] = unquote(password)
    if parts.scheme.lower() == "rediss+cluster":
        options["ssl"] = True
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in own_params:
            params[name] = value
        elif name == "client_name":
            options[name] = value
        elif name in CLUSTER_OPTIONS:
            try:
                options[name] = URL_QUERY_ARGUMENT_PARSERS[name](value)
            except (TypeError, ValueError):
                raise ValueError(f"parameter {name}: {value!r} is not valid") from None
        else:
            known = ", ".join((*CLUSTER_OPTIONS, "client_name", *own_params))
            raise ValueError(f"unknown parameter {name!r} (known: {known})")
    return ClusterTarget(nodes=address_list(netloc, DEFAULT_PORT, "cluster node", _port), options=options, params=params)


def _unavailable(exc: Exception) -> Exception:
    """The outage `exc` means, as a ConnectionError; `exc` itself when it is no outage."""
    if isinstance(exc, ClusterDownError | SlotNotCoveredError):
        return ClusterUnavailable(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, UNREACHABLE_ERRORS) or (
            type(exc) is RedisClusterException and "cannot be connected" in str(exc)):
        return ClusterUnavailable(str(exc))
    return exc


def _stream_keys(args: tuple) -> list | None:
    """The streams an XREAD/XREADGROUP names (the first half of what follows STREAMS); None
    for any other command."""
    if not args or str(args[0]).upper() not in ("XREAD", "XREADGROUP"):
        return None
    for i, a in enumerate(args):
        if (a.decode() if isinstance(a, bytes) else str(a)).upper() == "STREAMS":
            rest = args[i + 1:]
            return list(rest[:len(rest) // 2])
    return None


class _ScriptLoader:
    """The Lua scripts registered on one client, and whether every primary has them."""

    def __init__(self) -> None:
        self.bodies: dict[str, Any] = {}  # sha -> body
        self.loaded = False
        self.lock = threading.Lock()

    def add(self, script: Any) -> Any:
        if script.sha not in self.bodies:
            self.bodies[script.sha] = script.script
            self.loaded = False
        return script

    def due(self, stack: list) -> bool:
        return not self.loaded and any(str(c.args[0]).upper() == "EVALSHA" for c in stack)


# -- blocking --------------------------------------------------------------------------------

class _KeysFromStreams:
    def _get_command_keys(self, *args):
        keys = _stream_keys(args)
        return keys if keys is not None else super()._get_command_keys(*args)


class ClusterPipeline(_KeysFromStreams, redis.cluster.ClusterPipeline):
    _rb_scripts: _ScriptLoader
    _rb_client: ClusterClient

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> ClusterPipeline:
        # redis-py refuses EVALSHA in a cluster pipeline; its keys name the slot like any
        # command's, and the scripts are loaded before the pipeline goes out (`execute`).
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = list(self._execution_strategy.command_queue)
        try:
            if self._rb_scripts.due(stack):
                self._rb_client.load_scripts()
            replies = super().execute(raise_on_error)
            if isinstance(self._execution_strategy, redis.cluster.TransactionStrategy):
                replies = self._parsed(replies, stack)
            return replies
        except NoScriptError:
            self._rb_scripts.loaded = False
            raise
        except (ClusterDownError, SlotNotCoveredError, RedisClusterException) as exc:
            raise _unavailable(exc) from exc

    def _parsed(self, replies: list[Any], stack: list) -> list[Any]:
        """EXEC's replies as a plain client gives them: redis-py's cluster transaction leaves
        them as the server sent them (RESP3 maps for XREAD, lists for SMEMBERS, ...)."""
        node = next((n.redis_connection for n in self.nodes_manager.nodes_cache.values()
                     if n.redis_connection is not None), None)
        if node is None:
            return replies
        callbacks = node.response_callbacks
        out = []
        for reply, c in zip(replies, stack):
            name = c.args[0]
            if not isinstance(reply, Exception) and name in callbacks:
                options = {k: v for k, v in c.options.items() if k != "keys"}
                reply = callbacks[name](reply, **options)
            out.append(reply)
        return out


class ClusterClient(_KeysFromStreams, redis.cluster.RedisCluster):
    """redis-py's blocking `RedisCluster` with the changes in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_rb_init"] = (args, kwargs, threading.Lock())
        self.__dict__["_rb_scripts"] = _ScriptLoader()
        self._rb_connect(first=True)

    def _rb_connect(self, first: bool = False) -> None:
        args, kwargs, lock = self.__dict__["_rb_init"]
        with lock:
            if "nodes_manager" in self.__dict__:
                return
            self.__dict__["_rb_connecting"] = threading.get_ident()
            try:
                super().__init__(*args, **kwargs)
            except Exception as exc:
                error = _unavailable(exc)
                if not isinstance(error, redis.ConnectionError | redis.TimeoutError):
                    raise  # a mistake (a bad option), not an outage
                self.__dict__.pop("nodes_manager", None)  # not connected: try again on use
                if first:
                    return
                if error is exc:
                    raise
                raise error from exc
            finally:
                self.__dict__["_rb_connecting"] = None

    def __getattr__(self, name: str) -> Any:
        # Only attributes that are not there arrive here: before the first connection, the
        # ones the cluster's map makes. Make it now (or raise ClusterUnavailable); another
        # thread asking meanwhile waits for it, the connecting one's own questions do not.
        d = self.__dict__
        if name.startswith("__") or "_rb_init" not in d or "nodes_manager" in d \
                or d.get("_rb_connecting") == threading.get_ident():
            raise AttributeError(name)
        self._rb_connect()
        return getattr(self, name)

    def close(self) -> None:
        if "nodes_manager" in self.__dict__:
            super().close()

    def register_script(self, script: Any) -> Any:
        return self._rb_scripts.add(super().register_script(script))

    def load_scripts(self) -> None:
        """SCRIPT LOAD every registered script on every primary."""
        with self._rb_scripts.lock:
            for body in list(self._rb_scripts.bodies.values()):
                self.script_load(body)
            self._rb_scripts.loaded = True

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except (ClusterDownError, SlotNotCoveredError, RedisClusterException) as exc:
            raise _unavailable(exc) from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = ClusterPipeline  # redis-py's, with the changes above
        pipe._rb_scripts = self._rb_scripts
        pipe._rb_client = self
        return pipe


# -- asyncio ---------------------------------------------------------------------------------

class _Queued:
    """What queuing a script on an asyncio pipeline returns: redis-py's `Script` awaits it,
    and awaiting the pipeline itself would empty its queue (`ClusterPipeline.initialize`)."""

    def __init__(self, pipe: AsyncClusterPipeline) -> None:
        self._pipe = pipe

    def __await__(self):
        return self._done().__await__()

    async def _done(self) -> AsyncClusterPipeline:
        return self._pipe


class _AsyncTransaction(aiocluster.TransactionStrategy):
    """redis-py's MULTI/EXEC on one slot, with each command's slot found when the transaction
    goes out, on the caller's event loop: redis-py finds it as the command is queued, on a new
    thread running its own event loop (which breaks a client it has to connect first)."""

    def execute_command(self, *args: Any, **kwargs: Any) -> AsyncClusterPipeline:
        if args[0] in self.IMMEDIATE_EXECUTE_COMMANDS:
            raise RedisClusterException(f"{args[0]}: not offered on this cluster pipeline")
        return aiocluster.AbstractStrategy.execute_command(self, *args, **kwargs)

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True
                      ) -> list[Any]:
        client = self._pipe.cluster_client
        if client._initialize:
            await client.initialize()
        for c in self._command_queue:
            self._pipeline_slots.add(await client._determine_slot(*c.args))
            # redis-py hands a command's kwargs to its reply's parser, `keys` (there for its
            # client-side cache) included, which some parsers refuse.
            c.kwargs.pop("keys", None)
        return await super().execute(raise_on_error, allow_redirections)


class AsyncClusterPipeline(aiocluster.ClusterPipeline):
    def __init__(self, client: AsyncClusterClient, transaction: Any = None) -> None:
        super().__init__(client, transaction)
        if transaction:
            self._execution_strategy = _AsyncTransaction(self)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> _Queued:
        self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)
        return _Queued(self)

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True
                      ) -> list[Any]:
        client: AsyncClusterClient = self.cluster_client  # type: ignore[assignment]
        try:
            if client._rb_scripts.due(self._execution_strategy._command_queue):
                await client.load_scripts()
            return await super().execute(raise_on_error, allow_redirections)
        except NoScriptError:
            client._rb_scripts.loaded = False
            raise
        except (ClusterDownError, SlotNotCoveredError, RedisClusterException) as exc:
            raise _unavailable(exc) from exc


class AsyncClusterClient(aiocluster.RedisCluster):
    """redis-py's asyncio `RedisCluster` with the changes in the module docstring (it
    connects on first use by itself)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rb_scripts = _ScriptLoader()

    def register_script(self, script: Any) -> Any:
        return self._rb_scripts.add(super().register_script(script))

    async def load_scripts(self) -> None:
        for body in list(self._rb_scripts.bodies.values()):
            await self.script_load(body)
        self._rb_scripts.loaded = True

    async def _determine_slot(self, command: str, *args: Any) -> int:
        keys = _stream_keys((command, *args))
        if not keys:
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(k) for k in keys}
        if len(slots) != 1:
            raise RedisClusterException(f"{command} - all keys must map to the same key slot")
        return slots.pop()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except (ClusterDownError, SlotNotCoveredError, RedisClusterException) as exc:
            raise _unavailable(exc) from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> AsyncClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return AsyncClusterPipeline(self, transaction)


def _startup(target: ClusterTarget, cls: Any) -> list:
    return [cls(host, port) for host, port in target.nodes]


def cluster_client(target: ClusterTarget, **options: Any) -> ClusterClient:
    """A blocking client of the cluster; `options` as `broker.redis_conn` gives every client
    (its `retry` is the cluster client's own: how often a command is tried again after the
    map is refreshed)."""
    opts = {**options, **target.options}
    opts.pop("retry_on_error", None)  # not a cluster option; outages are the loops' to wait
    return ClusterClient(startup_nodes=_startup(target, redis.cluster.ClusterNode), **opts)


def cluster_client_async(target: ClusterTarget, **options: Any) -> AsyncClusterClient:
    """`cluster_client` for asyncio."""
    opts = {**options, **target.options}
    return AsyncClusterClient(startup_nodes=_startup(target, aiocluster.ClusterNode), **opts)
