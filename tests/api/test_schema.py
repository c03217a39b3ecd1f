"""Schemathesis over the OpenAPI schema, in process (ASGI): no 5xx, every response as declared.

Bounded and deterministic (derandomized, few examples per operation). Runs against a live
namespace with a backend and a broker, so reads see real ledgers and heartbeats. Checks that
judge business rules ("schema-valid data must be accepted") are left out on purpose: a session
with an unknown workload is schema-valid JSON that the API must refuse.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app  # noqa: E402
from tests.api.helpers import session_json  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture
def api_schema(settings, fleet, redis_client):
    fleet.backend("b0", hold=True)
    fleet.start_broker("least_loaded")
    app = create_app(settings)
    from fastapi.testclient import TestClient

    with TestClient(app) as seed:  # a few known sessions and a mixture for the reads to find
        seed.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(3)]})
        seed.put("/v1/mixture", json={"shares": {"rlvr": 1.0}})
    return schemathesis.openapi.from_asgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=8, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    case.call_and_validate(checks=CHECKS)
