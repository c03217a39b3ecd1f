from hypothesis import given, settings
from hypothesis import strategies as st

from broker.policies.prefix_tree import PrefixTree


def test_match_is_per_tenant_longest_routed_prefix() -> None:
    tree = PrefixTree()
    tree.insert((1, 2, 3, 4), "a")
    tree.insert((1, 2, 5), "b")
    tree.check()
    assert tree.match_lengths((1, 2, 3, 9)) == {"a": 3, "b": 2}
    assert tree.match_lengths((1, 2, 5, 6)) == {"a": 2, "b": 3}
    assert tree.match_lengths((7,)) == {"a": 0, "b": 0}
    assert tree.size == {"a": 4, "b": 3}


def test_a_prefix_of_an_existing_entry_splits_without_double_counting() -> None:
    tree = PrefixTree()
    tree.insert((1, 2, 3, 4, 5, 6), "a")
    tree.insert((1, 2, 3), "b")
    tree.insert((1, 2, 3), "a")
    tree.check()
    assert tree.size == {"a": 6, "b": 3}
    assert tree.match_lengths((1, 2, 3, 4, 5, 6, 7)) == {"a": 6, "b": 3}


def test_eviction_drops_the_least_recently_routed_leaf_first() -> None:
    tree = PrefixTree()
    tree.insert((1,) * 10, "a")  # older
    tree.insert((2,) * 10, "a")  # newer
    tree.insert((3,) * 10, "b")
    tree.evict(max_size=10)
    tree.check()
    assert tree.match_lengths((1,) * 10)["a"] == 0
    assert tree.match_lengths((2,) * 10)["a"] == 10
    assert tree.size == {"a": 10, "b": 10}  # b was within budget: untouched


def test_eviction_goes_leaf_first_then_up_to_the_shared_parent() -> None:
    tree = PrefixTree()
    tree.insert((1, 2, 3, 4), "a")
    tree.insert((1, 2, 5, 6), "a")
    tree.evict(max_size=3)  # 6 tokens held: both 2-token leaves go, the shared (1, 2) stays
    tree.check()
    assert tree.size["a"] == 2
    assert tree.match_lengths((1, 2, 5, 6))["a"] == 2


def test_remove_tenant_forgets_it_and_prunes_its_nodes() -> None:
    tree = PrefixTree()
    tree.insert((1, 2, 3), "a")
    tree.insert((1, 2, 4), "b")
    tree.remove_tenant("a")
    tree.check()
    assert tree.tenants() == ["b"]
    assert tree.match_lengths((1, 2, 3)) == {"b": 2}


def test_long_sequences_share_storage_and_match_exactly() -> None:
    tree = PrefixTree()
    system = tuple(range(5000))
    for i in range(50):
        tree.insert(system + tuple(range(10_000 + 100 * i, 10_000 + 100 * i + 3000)), f"b{i % 4}")
    tree.check()
    probe = system + tuple(range(10_000 + 100 * 7, 10_000 + 100 * 7 + 1500)) + (-1,)
    assert tree.match_lengths(probe)["b3"] == 6500  # request 7 went to b3; 1500 of its tail match


sequences = st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple)
inserts = st.lists(st.tuples(sequences, st.sampled_from("abc")), max_size=25)


@settings(max_examples=200, deadline=None)
@given(inserts, sequences)
def test_match_lengths_equal_brute_force_longest_common_prefix(ops, probe) -> None:
    tree = PrefixTree()
    for seq, tenant in ops:
        tree.insert(seq, tenant)
    tree.check()

    def lcp(x: tuple[int, ...], y: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    expected = {t: max(lcp(probe, s) for s, u in ops if u == t) for _, t in ops}
    assert tree.match_lengths(probe) == expected


@settings(max_examples=200, deadline=None)
@given(inserts, st.integers(0, 20), sequences)
def test_eviction_meets_the_budget_and_only_forgets(ops, budget, probe) -> None:
    tree = PrefixTree()
    for seq, tenant in ops:
        tree.insert(seq, tenant)
    before = tree.match_lengths(probe)
    tree.evict(budget)
    tree.check()
    assert all(size <= budget for size in tree.size.values())
    after = tree.match_lengths(probe)
    assert all(after.get(t, 0) <= n for t, n in before.items())
