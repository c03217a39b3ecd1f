"""POST/GET/DELETE /v1/sessions: the client's validation and idempotency, over HTTP."""

from __future__ import annotations

import pytest

from broker.ledger import Ledger
from broker.keys import Keys
from tests.api.helpers import session_json
from tests.broker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def test_enqueue_is_idempotent(api):
    r = api.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(3)]})
    assert r.status_code == 200
    assert r.json() == {"enqueued": ["s0", "s1", "s2"], "duplicates": []}
    r = api.post("/v1/sessions", json={"sessions": [session_json(2), session_json(3)]})
    assert r.json() == {"enqueued": ["s3"], "duplicates": ["s2"]}
    st = api.get("/v1/status").json()
    assert {w["workload"]: w["depth"] for w in st["workloads"]}["rlvr"] == 4


@pytest.mark.parametrize("item, field, reason", [
    ({"workload": "nope"}, "sessions[1].workload", "unknown workload 'nope'"),
    ({"max_tokens": 0}, "sessions[1].max_tokens", "must be a positive number"),
    ({"prompt_token_ids": None}, "sessions[1].prompt", "exactly one non-empty"),
    ({"session_id": "has space"}, "sessions[1].session_id", "must be 1-128 characters"),
    ({"colour": "red"}, "sessions[1].colour", "Extra inputs are not permitted"),
])
def test_a_bad_item_rejects_the_whole_batch_naming_field_and_reason(api, item, field, reason):
    batch = [session_json(0), {**session_json(1), **item}]
    r = api.post("/v1/sessions", json={"sessions": batch})
    assert r.status_code == 422
    body = r.json()
    assert body["field"] == field and reason in body["reason"]
    assert api.get("/v1/sessions/s0").status_code == 404  # nothing half-enqueued


def test_prompt_longer_than_every_backend_is_refused(api, redis_client, namespace):
    Ledger(redis_client, Keys(namespace)).register_backend("b0", 1000, max_model_len=16)
    r = api.post("/v1/sessions", json={"sessions": [session_json(0, prompt_len=17)]})
    assert r.status_code == 422
    assert r.json()["field"] == "sessions[0].prompt_token_ids"
    assert "largest max_model_len is 16" in r.json()["reason"]


@pytest.mark.parametrize("body, field", [
    ({"sessions": []}, "sessions"),
    ({}, "sessions"),
    ({"sessions": [], "extra": 1}, "sessions"),
])
def test_malformed_bodies(api, body, field):
    r = api.post("/v1/sessions", json=body)
    assert r.status_code == 422 and r.json()["field"] == field


def test_get_session_and_its_404(api):
    api.post("/v1/sessions", json={"sessions": [session_json(7, workload="rlhf")]})
    s = api.get("/v1/sessions/s7").json()
    assert s["state"] == "pending" and s["workload"] == "rlhf" and s["backend_id"] is None
    assert s["session"]["prompt_token_ids"] == list(range(1, 9))
    assert s["enqueued_at"] > 0
    r = api.get("/v1/sessions/missing")
    assert r.status_code == 404 and r.json()["field"] == "session_id"
    r = api.get("/v1/sessions/bad%20id")
    assert r.status_code == 422 and r.json()["field"] == "session_id"


def test_cancel_pending_twice_then_unknown(api):
    api.post("/v1/sessions", json={"sessions": [session_json(1)]})
    assert api.delete("/v1/sessions/s1").json() == {"session_id": "s1", "cancelled": True,
                                                    "state": "cancelled"}
    assert api.delete("/v1/sessions/s1").json()["state"] == "cancelled"
    assert api.get("/v1/sessions/s1").json()["state"] == "cancelled"
    assert api.delete("/v1/sessions/s9").status_code == 404


def test_sessions_run_to_done_and_cannot_be_cancelled_after(api, fleet):
    fleet.backend("b0")
    fleet.backend("b1")
    fleet.start_broker("least_loaded")
    api.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(10)]})
    assert wait_until(lambda: all(api.get(f"/v1/sessions/s{i}").json()["state"] == "done"
                                  for i in range(10)), timeout=20)
    s = api.get("/v1/sessions/s4").json()
    assert s["backend_id"] in ("b0", "b1") and s["finished_at"] >= s["admitted_at"]
    assert api.delete("/v1/sessions/s4").json() == {"session_id": "s4", "cancelled": False,
                                                    "state": "done"}


def test_cancel_a_resident_session_releases_its_reservation(api, fleet):
    fleet.backend("b0", hold=True)
    fleet.start_broker("least_loaded")
    api.post("/v1/sessions", json={"sessions": [session_json(1)]})
    assert wait_until(lambda: api.get("/v1/sessions/s1").json()["state"] == "running", timeout=20)
    assert api.delete("/v1/sessions/s1").json()["cancelled"] is True
    b0 = api.get("/v1/backends").json()[0]
    assert b0["reserved_tokens"] == 0 and b0["sessions"] == 0


@pytest.mark.parametrize("body", [b"not json", b'{"sessions": x}'])
def test_a_body_that_is_not_json_is_named_as_the_body(api, body):
    r = api.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["field"] == "body" and r.json()["reason"]


def test_an_empty_body_is_named_as_the_body(api):
    r = api.post("/v1/sessions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body"
