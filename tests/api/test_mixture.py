"""PUT/GET /v1/mixture through the client's checks."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


def test_set_and_read_mixture(api):
    r = api.put("/v1/mixture", json={"shares": {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}})
    assert r.status_code == 200
    assert api.get("/v1/mixture").json()["shares"] == pytest.approx(
        {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2})
    assert api.get("/v1/status").json()["mixture"]["target"]["rlvr"] == 0.5


@pytest.mark.parametrize("shares, field, reason", [
    ({"rlvr": 0.5, "rlhf": 0.6}, "shares", "sum to 1.1"),
    ({"rlvr": 1.0, "chess": 0.0}, "shares.chess", "unknown workload"),
    ({"rlvr": 1.5, "rlhf": -0.5}, "shares.rlhf", "must be a finite number ≥ 0"),
    ({}, "shares", "at least one"),
])
def test_bad_mixtures_say_which_share(api, shares, field, reason):
    r = api.put("/v1/mixture", json={"shares": shares})
    assert r.status_code == 422
    assert r.json()["field"] == field and reason in r.json()["reason"]
    assert api.get("/v1/mixture").json() == {"shares": {}}


@pytest.mark.parametrize("shares, field", [
    ({"rlvr": "1"}, "shares.rlvr"),
    ({"rlvr": True}, "shares.rlvr"),
    ({"rlvr": 0.5, "rlhf": "0.5"}, "shares.rlhf"),
    ({"rlvr": 0.5, "rlhf": False, "agentic": 0.5}, "shares.rlhf"),
])
def test_a_share_must_be_a_json_number(api, shares, field):
    r = api.put("/v1/mixture", json={"shares": shares})
    assert r.status_code == 422
    assert r.json()["field"] == field and "number" in r.json()["reason"]
    assert api.get("/v1/mixture").json() == {"shares": {}}


@pytest.mark.parametrize("raw", [b'{"shares": {"rlvr": NaN}}', b'{"shares": {"rlvr": Infinity}}'])
def test_a_share_must_be_finite(api, raw):
    r = api.put("/v1/mixture", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "shares.rlvr"
    assert api.get("/v1/mixture").json() == {"shares": {}}


def test_integer_shares_are_numbers(api):
    r = api.put("/v1/mixture", json={"shares": {"rlvr": 1, "rlhf": 0}})
    assert r.status_code == 200 and r.json() == {"shares": {"rlvr": 1.0, "rlhf": 0.0}}
