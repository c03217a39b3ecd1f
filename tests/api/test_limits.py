"""The request-body limit: a body over `max_body_bytes` is refused with a 413 naming the body,
by its Content-Length before it is read, or as soon as a body without one streams past it."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.limits import BodyLimit
from api.settings import ApiSettings
from tests.api.helpers import session_json

pytestmark = pytest.mark.timeout(30)

LIMIT = 1000
JSON = {"content-type": "application/json"}


def batch(n: int) -> bytes:
    """`n` sessions as a trainer sends them (fields left at None are left out)."""
    return json.dumps({"sessions": [{k: v for k, v in session_json(i).items() if v is not None}
                                    for i in range(n)]}).encode()


def chunked(body: bytes, size: int = 100):
    for i in range(0, len(body), size):
        yield body[i:i + size]


@pytest.fixture
def limited(redis_url, namespace, redis_client):
    settings = ApiSettings(redis_url=redis_url, namespace=namespace, max_body_bytes=LIMIT)
    with TestClient(create_app(settings)) as client:
        yield client


def test_the_limit_defaults_to_16_mib_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv("RB_API_MAX_BODY_BYTES", raising=False)
    assert ApiSettings().max_body_bytes == 16 * 1024 * 1024
    monkeypatch.setenv("RB_API_MAX_BODY_BYTES", "2048")
    assert ApiSettings().max_body_bytes == 2048


@pytest.mark.redis
def test_a_body_over_the_limit_is_refused_by_its_length(limited):
    body = batch(20)
    assert len(body) > LIMIT
    r = limited.post("/v1/sessions", content=body, headers=JSON)
    assert r.status_code == 413
    assert r.json() == {"field": "body", "reason": f"request body of {len(body)} bytes exceeds "
                                                   f"the limit of {LIMIT} bytes"}
    assert limited.get("/v1/sessions/s0").status_code == 404


@pytest.mark.redis
def test_a_chunked_body_over_the_limit_is_refused(limited):
    body = batch(20)
    r = limited.post("/v1/sessions", content=chunked(body), headers=JSON)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert r.json()["field"] == "body"
    assert r.json()["reason"].endswith(f"exceeds the limit of {LIMIT} bytes")
    assert limited.get("/v1/sessions/s0").status_code == 404


@pytest.mark.redis
def test_bodies_under_the_limit_are_served(limited):
    body = batch(1)
    assert len(batch(2)) < LIMIT
    r = limited.post("/v1/sessions", content=body, headers=JSON)
    assert r.status_code == 200 and r.json()["enqueued"] == ["s0"]
    r = limited.post("/v1/sessions", content=chunked(batch(2)), headers=JSON)
    assert r.status_code == 200 and r.json() == {"enqueued": ["s1"], "duplicates": ["s0"]}
    r = limited.put("/v1/mixture", json={"shares": {"rlvr": 1.0}})
    assert r.status_code == 200


def test_the_openapi_documents_the_413_where_a_body_is_taken():
    paths = create_app(ApiSettings()).openapi()["paths"]
    for path, method in (("/v1/sessions", "post"), ("/v1/mixture", "put")):
        ref = paths[path][method]["responses"]["413"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": "#/components/schemas/ErrorPublic"}, (path, method)


# The middleware alone, over a raw ASGI exchange: what it reads and what it answers.
class Exchange:
    def __init__(self, headers: dict[str, str], chunks: list[bytes]) -> None:
        self.scope = {"type": "http", "method": "POST", "path": "/", "headers": [
            (k.lower().encode(), v.encode()) for k, v in headers.items()]}
        self.chunks = chunks
        self.reads = 0
        self.sent: list[dict] = []
        self.app_read: list[bytes] = []

    async def receive(self) -> dict:
        self.reads += 1
        i = self.reads - 1
        if i >= len(self.chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self.chunks[i],
                "more_body": i + 1 < len(self.chunks)}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def app(self, scope, receive, send) -> None:
        while True:
            message = await receive()
            self.app_read.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def run(self, limit: int) -> tuple[int, dict | None]:
        asyncio.run(BodyLimit(self.app, limit)(self.scope, self.receive, self.send))
        status = self.sent[0]["status"]
        body = b"".join(m.get("body", b"") for m in self.sent[1:])
        return status, json.loads(body) if status != 200 else None


def test_a_declared_length_over_the_limit_is_answered_without_reading_the_body():
    ex = Exchange({"content-length": "5000"}, [b"x" * 2500, b"x" * 2500])
    status, body = ex.run(LIMIT)
    assert status == 413 and ex.reads == 0 and ex.app_read == []
    assert body == {"field": "body",
                    "reason": f"request body of 5000 bytes exceeds the limit of {LIMIT} bytes"}


def test_a_streamed_body_is_cut_off_once_it_passes_the_limit():
    ex = Exchange({}, [b"x" * 300] * 10)
    status, body = ex.run(LIMIT)
    assert status == 413 and ex.reads == 4  # 300, 600, 900, then 1200 > 1000: no fifth read
    assert body["field"] == "body" and body["reason"].endswith(f"the limit of {LIMIT} bytes")
    assert len(ex.sent) == 2  # the app's own answer never went out


def test_bodies_within_the_limit_pass_through_whole():
    for headers in ({"content-length": str(LIMIT)}, {}):
        ex = Exchange(headers, [b"x" * 500, b"x" * 500])
        assert ex.run(LIMIT) == (200, None)
        assert b"".join(ex.app_read) == b"x" * LIMIT
