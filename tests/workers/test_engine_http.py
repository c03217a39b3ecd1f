"""The engine client (workers/engine_http.py): httpx's API over aiohttp's pool, against real
servers on loopback: bodies and headers both ways, gzip, connections reused, and each failure
an engine can cause surfacing as the httpx exception the runner already handles."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from broker.redis_server import free_port
from sim.server.testing import serving
from workers.engine_http import engine_client
from workers.runner import EngineUnavailable, RunnerSettings, SessionRunner


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"body": body, "client_port": request.client.port,
                             "content_type": request.headers.get("content-type")},
                            headers={"x-engine": "sim"})

    @app.get("/gzip")
    async def gz() -> Response:
        return Response(gzip.compress(b'{"ok": true}'), media_type="application/json",
                        headers={"content-encoding": "gzip"})

    @app.post("/slow")
    async def slow() -> dict:
        await asyncio.sleep(5)
        return {}

    @app.get("/status/{code}")
    async def status(code: int) -> Response:
        return Response(b"overloaded", status_code=code)

    return app


@pytest.fixture(scope="module")
def server() -> str:
    with serving(_app(), "127.0.0.1", "engine-http-test") as port:
        yield f"http://127.0.0.1:{port}"


def test_round_trip_keeps_httpx_api_and_reuses_connections(server: str) -> None:
    async def go() -> None:
        async with engine_client(10.0) as http:
            first = await http.post(f"{server}/echo", json={"prompt": [1, 2, 3]})
            again = await http.post(f"{server}/echo", json={"prompt": [4]})
            assert first.status_code == 200 and first.headers["x-engine"] == "sim"
            assert first.json()["body"] == {"prompt": [1, 2, 3]}
            assert first.json()["content_type"] == "application/json"
            # one after the other: the same keep-alive connection, so the same client port
            assert again.json()["client_port"] == first.json()["client_port"]
            assert (await http.get(f"{server}/gzip")).json() == {"ok": True}
            many = await asyncio.gather(*(http.post(f"{server}/echo", json={"i": i})
                                          for i in range(64)))
            assert [r.json()["body"]["i"] for r in many] == list(range(64))
    asyncio.run(go())


def test_status_codes_come_back_as_they_are(server: str) -> None:
    async def go() -> None:
        async with engine_client(10.0) as http:
            r = await http.get(f"{server}/status/503")
            assert r.status_code == 503 and r.text == "overloaded"
    asyncio.run(go())


def test_refused_connection_is_a_connect_error() -> None:
    async def go() -> None:
        async with engine_client(2.0) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://127.0.0.1:{free_port()}/health")
    asyncio.run(go())


def test_slow_reply_is_a_read_timeout(server: str) -> None:
    async def go() -> None:
        async with engine_client(10.0) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{server}/slow", json={}, timeout=0.3)
    asyncio.run(go())


def test_connection_closed_without_reply_is_a_transport_error() -> None:
    """An engine that dies mid-request: the socket closes before any reply."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]

    async def go() -> None:
        loop = asyncio.get_running_loop()

        async def accept_and_close() -> None:
            conn, _ = await loop.sock_accept(sock)
            await loop.sock_recv(conn, 65536)
            conn.close()

        sock.setblocking(False)
        closer = asyncio.create_task(accept_and_close())
        async with engine_client(5.0) as http:
            with pytest.raises(httpx.TransportError) as caught:
                await http.post(f"http://127.0.0.1:{port}/inference/v1/generate",
                                json={"token_ids": [1]})
        assert isinstance(caught.value, (httpx.RemoteProtocolError, httpx.ReadError))
        await closer
    try:
        asyncio.run(go())
    finally:
        sock.close()


def test_runner_hands_back_on_a_refused_engine() -> None:
    """Through the runner, a refused engine is `EngineUnavailable` (the worker requeues)."""
    async def go() -> None:
        async with engine_client(2.0) as http:
            runner = SessionRunner(http, f"http://127.0.0.1:{free_port()}", "m", 1000, None,
                                   RunnerSettings(retries=1, backoff_s=0.01))
            with pytest.raises(EngineUnavailable, match="ConnectError"):
                await runner.tokenize("hello")
    asyncio.run(go())


def test_json_body_bytes_are_what_httpx_encoded(server: str) -> None:
    """The body goes out as httpx encoded it (no re-encoding on the way)."""
    payload = {"text": "héllo", "ids": list(range(5))}

    async def go() -> None:
        async with engine_client(10.0) as http:
            r = await http.post(f"{server}/echo", content=json.dumps(payload).encode(),
                                headers={"content-type": "application/json"})
            assert r.json()["body"] == payload
    asyncio.run(go())
