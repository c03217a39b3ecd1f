"""misa_t_admission.PrefixKeys: a key computed once per waiting item, and memory that follows
what is still asked for, not everything the broker ever placed."""

from __future__ import annotations

from broker.policies.misa_t_admission import PrefixKeys
from tests.broker.policies.snapshots import item


def test_memory_stays_bounded_over_many_placements_and_a_waiting_key_is_kept():
    keys = PrefixKeys(generation=100)
    waiting = item("head", tuple(range(64)))
    first = keys.of(waiting)
    for i in range(20_000):  # a long run: each session placed once, the head asked every call
        keys.of(item(f"s{i}", (i, i + 1, i + 2)))
        assert keys.of(waiting) is first  # computed once, however long it waits
        assert len(keys) <= 200


def test_a_key_not_asked_for_over_two_generations_is_computed_again():
    keys = PrefixKeys(generation=10)
    gone = keys.of(item("gone", (1, 2, 3)))
    for i in range(20):
        keys.of(item(f"s{i}", (i,)))
    again = keys.of(item("gone", (1, 2, 3)))
    assert again is not gone and again == gone
