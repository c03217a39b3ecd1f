"""Enqueue refuses a session no engine could ever run, naming the field (pure: no Redis)."""

from __future__ import annotations

import pytest

from broker.ledger import EnqueueLimits
from broker.queue import validate_batch

BASE = {"session_id": "s", "workload": "rlhf", "prompt_token_ids": [1, 2, 3], "max_tokens": 8}
FLEET = EnqueueLimits(max_model_len=4096, models=frozenset({"m"}), lora=False,
                      adapters=frozenset({"ad"}))


def check(session: dict, limits: EnqueueLimits) -> None:
    validate_batch([{**BASE, **session}], {"rlhf"}, limits)


def test_an_adapter_needs_lora_on_some_engine():
    with pytest.raises(ValueError, match=r"^sessions\[0\]\.adapter: 'ad' needs an engine with "
                                         "LoRA on.*--enable-lora"):
        check({"adapter": "ad"}, FLEET)
    check({"adapter": "ad"}, EnqueueLimits(max_model_len=4096, lora=True,
                                           adapters=frozenset({"ad"})))


def test_an_adapter_must_be_registered_even_before_any_engine():
    with pytest.raises(ValueError, match=r"^sessions\[0\]\.adapter: 'x' is not registered in "
                                         r"this namespace \(registered: ad\)"):
        check({"adapter": "x"}, EnqueueLimits(adapters=frozenset({"ad"})))
    check({"model": "anything"}, EnqueueLimits())  # no engine yet: models are not judged


def test_a_model_must_be_served_by_a_registered_engine():
    with pytest.raises(ValueError, match=r"^sessions\[0\]\.model: 'other' is served by no "
                                         "registered backend; served: m"):
        check({"model": "other"}, FLEET)
    check({"model": "m"}, FLEET)


@pytest.mark.parametrize("field,value,why", [
    ("adapter", "has space", "is not an adapter name"),
    ("model", "", "must be 1-256 printable characters"),
    ("model", "a b", "must be 1-256 printable characters"),
])
def test_bad_names_are_refused_naming_the_field(field, value, why):
    with pytest.raises(ValueError, match=rf"^sessions\[0\]\.{field}: .*{why}"):
        check({field: value}, EnqueueLimits())
