"""The HTTP client that talks to engines: httpx's API over aiohttp's connection pool.

Why not httpx's own pool: httpcore 1.0's pool walks every connection it holds each time a request
is placed or released, and for each idle one counts them all again, so a request's CPU grows with
the square of the connections the process keeps. A worker keeps one per turn in flight on its
engine, the gateway one per call in flight. Measured on this 2-core machine (one process posting
vLLM-sized JSON to a local server that answers in 50 ms; docs/results/gateway.md, 2026-12-07):
8.2 ms of CPU a request with 64 in flight and 13.0 ms with 256 on httpx's pool; 0.44 and 0.39 ms
through this transport. aiohttp keeps the idle connections of each host in a queue and takes one
off it.

Callers keep httpx's API (`http.post(url, json=..., timeout=...)`, `httpx.Response`, httpx's
exceptions), so everything written against httpx (tests with `httpx.MockTransport` included)
works unchanged. Bodies are read whole before the response is returned (engines answer JSON, not
streams), which hands the connection back to the pool at once. Proxies from the environment are
not used: engines are reached directly.
"""

from __future__ import annotations

import aiohttp
import httpx

# How long an idle connection stays open for the next request: under the 5 s after which
# uvicorn (vLLM's server, and ours) closes it, so the client never reuses one the server is closing.
KEEPALIVE_S = 4.0


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request through one `aiohttp.ClientSession`, made on
    first use (it belongs to the running event loop); `max_connections` None: no limit."""

    def __init__(self, max_connections: int | None = None, keepalive_s: float = KEEPALIVE_S) -> None:
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections or 0, limit_per_host=0,
                                             keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"),
                                        sock_read=t.get("read"))
        body = await request.aread()
        try:
            async with self._open().request(
                    request.method, str(request.url), headers=[
                        (k, v) for k, v in request.headers.multi_items()
                        if k != "transfer-encoding"],
                    data=body or None, allow_redirects=False, timeout=timeout,
                    skip_auto_headers=("User-Agent", "Accept-Encoding")) as r:
                content = await r.read()
                return httpx.Response(r.status, headers=r.raw_headers, content=content,
                                      request=request,
                                      extensions={"http_version": b"HTTP/1.1",
                                                  "reason_phrase": (r.reason or "").encode()})
        except aiohttp.ClientError as exc:
            raise _as_httpx(exc, request) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _as_httpx(exc: aiohttp.ClientError, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception that says the same thing, so callers catch one family."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, no such host
        return httpx.ConnectError(text, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(text, request=request)
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return httpx.ReadError(text, request=request)
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(text, request=request)
    return httpx.TransportError(text, request=request)


def engine_client(timeout_s: float, max_connections: int | None = None) -> httpx.AsyncClient:
    """An httpx client for engine requests on `AiohttpTransport`: `timeout_s` for connecting
    and for each read (a request waits for room in the pool as long as it must)."""
    return httpx.AsyncClient(transport=AiohttpTransport(max_connections),
                             timeout=httpx.Timeout(timeout_s, pool=None))
