import pytest

from broker.keys import Keys


def test_every_key_has_its_exact_shape():
    k = Keys("job1")
    assert k.prefix == "rb:{job1}:"
    assert k.pending("rlvr") == "rb:{job1}:pending:rlvr"
    assert k.requeue("agentic") == "rb:{job1}:requeue:agentic"
    assert k.admitted("gpu-0") == "rb:{job1}:admitted:gpu-0"
    assert k.results == "rb:{job1}:results"
    assert k.dead_letter == "rb:{job1}:dead"
    assert k.events == "rb:{job1}:events"
    assert k.session("s:1") == "rb:{job1}:session:s:1"
    assert k.ledger("gpu-0") == "rb:{job1}:ledger:gpu-0"
    assert k.ledger_sessions("gpu-0") == "rb:{job1}:ledger:gpu-0:sessions"
    assert k.kv_seconds == "rb:{job1}:kvsec"
    assert k.heartbeat("gpu-0") == "rb:{job1}:hb:gpu-0"
    assert k.backends == "rb:{job1}:backends"
    assert k.workloads == "rb:{job1}:workloads"
    assert k.mixture == "rb:{job1}:mixture"
    assert k.consumed == "rb:{job1}:consumed"
    assert k.lease == "rb:{job1}:lease"
    assert k.weights == "rb:{job1}:weights"
    assert k.control == "rb:{job1}:control"
    assert k.paused_acks == "rb:{job1}:paused"
    assert k.paused_events == "rb:{job1}:paused:events"


@pytest.mark.parametrize("call, field", [
    (lambda: Keys("a{b}"), "namespace"),
    (lambda: Keys("ns").pending("Bad:Name"), "workload"),
    (lambda: Keys("ns").admitted("gpu:0"), "backend_id"),
    (lambda: Keys("ns").session("x y"), "session_id"),
])
def test_ids_that_would_break_a_key_are_refused_naming_the_field(call, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        call()
