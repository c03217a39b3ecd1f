"""Requeued sessions go in front of their workload's pending ones, in the policy's view."""

from broker.keys import Keys
from broker.service import BrokerService, BrokerSettings
from tests.broker.helpers import make_session
from tests.broker.policies_for_tests import HeadroomPolicy


def test_requeued_entries_come_first_then_pending_oldest_first(redis_url, namespace, redis_client):
    svc = BrokerService(redis_url, namespace, HeadroomPolicy(), BrokerSettings(window=3))
    k = Keys(namespace)
    svc._refresh_workloads(("rlvr",))
    for i, front in ((1, False), (2, False), (3, True), (4, False), (5, True)):
        s = make_session(i)
        stream = k.requeue("rlvr") if front else k.pending("rlvr")
        svc._hold(stream, f"{1000 + i}-0", {b"sid": s.session_id.encode(),
                                            b"session": s.model_dump_json().encode()}, front)
    view = svc._pending_view()
    assert [p.session_id for p in view["rlvr"]] == ["s3", "s5", "s1"]  # window of 3
    assert view["rlvr"][2].enqueued_at == 1.001
    svc._client.close()
