"""Bearer token on the mutating endpoints; no unauthenticated bind beyond loopback."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError
from typer.testing import CliRunner

from api.app import create_app
from api.settings import ApiSettings, check_bind, is_loopback, make_settings
from rollout_broker.cli import app as cli
from tests.api.helpers import session_json

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def secured(redis_url, namespace, redis_client):
    settings = ApiSettings(redis_url=redis_url, namespace=namespace, token="s3cret")
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.redis
@pytest.mark.parametrize("method, path, body", [
    ("post", "/v1/sessions", {"sessions": [session_json(1)]}),
    ("put", "/v1/mixture", {"shares": {"rlvr": 1.0}}),
    ("delete", "/v1/sessions/s1", None),
])
def test_mutations_need_the_token(secured, method, path, body):
    kw = {"json": body} if body is not None else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic czNjcmV0"}):
        r = secured.request(method, path, headers=headers, **kw)
        assert r.status_code == 401, headers
        assert r.json()["field"] == "authorization"
        assert r.headers["www-authenticate"] == "Bearer"
    r = secured.request(method, path, headers={"Authorization": "Bearer s3cret"}, **kw)
    assert r.status_code in (200, 404)  # 404: cancelling a session never enqueued


@pytest.mark.redis
def test_reads_need_no_token(secured):
    for path in ("/v1/status", "/v1/backends", "/v1/mixture", "/metrics", "/healthz", "/"):
        assert secured.get(path).status_code == 200, path


def test_openapi_declares_the_bearer_scheme():
    spec = create_app(ApiSettings()).openapi()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["paths"]["/v1/sessions"]["post"]["security"] == [{"HTTPBearer": []}]


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.53", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("api.example", False),
])
def test_loopback_detection(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_bind_needs_a_token():
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without a token"):
        check_bind(ApiSettings(host="0.0.0.0"))
    check_bind(ApiSettings(host="0.0.0.0", token="t"))
    check_bind(ApiSettings(host="127.0.0.1"))


@pytest.mark.parametrize("token", ["", " ", "   ", "\t\n "])
def test_a_blank_token_is_refused(monkeypatch, token):
    with pytest.raises(ValidationError) as info:
        ApiSettings(token=token)
    (err,) = info.value.errors()
    assert err["loc"] == ("token",) and str(err["ctx"]["error"]) == "token: must not be blank"
    monkeypatch.setenv("RB_API_TOKEN", token)
    with pytest.raises(ValidationError, match="token: must not be blank"):
        ApiSettings()
    with pytest.raises(ValueError, match=r"^token: must not be blank$"):
        make_settings(host="0.0.0.0")


def test_a_token_with_surrounding_spaces_is_kept_as_given():
    assert ApiSettings(token=" t0k ").token.get_secret_value() == " t0k "


def test_make_settings_names_the_field_in_one_line():
    assert make_settings(host="0.0.0.0", token="t").token.get_secret_value() == "t"
    with pytest.raises(ValueError, match=r"^port: .*65535$"):
        make_settings(port=70000)


def test_a_blank_token_does_not_open_a_public_bind():
    with pytest.raises(ValueError, match="token: must not be blank"):
        check_bind(ApiSettings(host="0.0.0.0", token="   "))
    unchecked = ApiSettings.model_construct(host="0.0.0.0", token=SecretStr("  "))
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without a token"):
        check_bind(unchecked)


def test_cli_refuses_public_bind_without_token(monkeypatch):
    monkeypatch.delenv("RB_API_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["api", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to bind '0.0.0.0' without a token" in result.output


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_cli_refuses_a_blank_token(monkeypatch, host):
    monkeypatch.delenv("RB_API_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["api", "--host", host, "--port", "1", "--token", "   "])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["rollout-broker api: token: must not be blank"]
