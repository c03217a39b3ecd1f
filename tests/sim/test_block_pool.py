"""Block pool: chained hashes, the LRU free queue, ref counts, eviction on reuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.block_pool import ROOT_HASH, BlockPool, chain_hashes, hash_block

BS = 16
tokens = st.lists(st.integers(0, 50), min_size=0, max_size=120)


# -- hash chains -------------------------------------------------------------------------

@settings(deadline=None, derandomize=True, max_examples=60)
@given(prefix=tokens, a=tokens, b=tokens)
def test_equal_prefixes_give_equal_chains(prefix, a, b):
    ha, hb = chain_hashes(prefix + a, BS), chain_hashes(prefix + b, BS)
    shared = len(prefix) // BS
    assert ha[:shared] == hb[:shared] == chain_hashes(prefix, BS)
    assert len(ha) == len(prefix + a) // BS  # only full blocks are hashed


@settings(deadline=None, derandomize=True, max_examples=60)
@given(seq=st.lists(st.integers(0, 50), min_size=BS, max_size=120), data=st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(seq, data):
    n_full = len(seq) // BS
    pos = data.draw(st.integers(0, n_full * BS - 1))
    other = list(seq)
    other[pos] += 1
    h, g = chain_hashes(seq, BS), chain_hashes(other, BS)
    changed = pos // BS
    assert h[:changed] == g[:changed]
    # Chained: every block from the changed one on differs (64-bit collisions aside).
    assert all(x != y for x, y in zip(h[changed:], g[changed:], strict=True))


def test_chain_is_parent_then_block_and_resumable():
    seq = list(range(50))
    h = chain_hashes(seq, BS)
    assert h[0] == hash_block(ROOT_HASH, tuple(seq[:16]))
    assert h[1] == hash_block(h[0], tuple(seq[16:32]))
    # Extending from block 1 with the parent hash gives the same tail (how requests extend).
    assert chain_hashes(seq, BS, parent=h[0], start_block=1) == h[1:]
    assert chain_hashes(seq, BS, stop_block=2) == h[:2]
    # Same block content at a different position (different parent) hashes differently.
    rep = list(range(16)) * 2
    hr = chain_hashes(rep, BS)
    assert hr[0] != hr[1]


# -- the free queue ----------------------------------------------------------------------

def test_null_block_is_never_handed_out_and_not_in_usage():
    pool = BlockPool(5)
    assert pool.num_free == 4 and pool.usage() == 0.0
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]  # head first, block 0 never
    assert pool.usage() == 1.0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(got[:1])
    assert pool.usage() == pytest.approx(1 - 1 / 4)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_eviction_order_is_least_recently_freed_first():
    pool = BlockPool(7)
    b = {x.block_id: x for x in pool.get_new_blocks(6)}
    for i, bid in enumerate([4, 2, 6, 1, 5, 3]):
        pool.cache_block(b[bid], 1000 + bid)
    pool.free_blocks([b[4], b[2]])  # freed first → reused first
    pool.free_blocks([b[6]])
    pool.free_blocks([b[1], b[5], b[3]])
    assert list(pool.free) == [4, 2, 6, 1, 5, 3]
    # All still hit while free.
    assert all(pool.lookup(1000 + i) is b[i] for i in range(1, 7))
    first = pool.get_new_blocks(2)
    assert [x.block_id for x in first] == [4, 2]
    # Reuse evicts exactly those hashes, in that order, and nothing else.
    assert pool.lookup(1004) is None and pool.lookup(1002) is None
    assert pool.lookup(1006) is b[6] and pool.evictions == 2
    assert first[0].block_hash is None and first[0].ref_cnt == 1
    pool.check_invariants()


def test_hit_on_a_free_block_pulls_it_out_of_the_queue_and_refreezes_at_tail():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], 7)
    pool.free_blocks(blocks[::-1])  # tail-first, as a request frees: 3, 2, 1
    assert list(pool.free) == [3, 2, 1]
    hit = pool.lookup(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and list(pool.free) == [3, 2]
    pool.free_blocks([hit])
    assert list(pool.free) == [3, 2, 1]  # back at the tail: most recently used
    pool.check_invariants()


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(3)
    blk, = pool.get_new_blocks(1)
    pool.cache_block(blk, 42)
    pool.touch([blk])  # a second request hits it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free
    pool.check_invariants()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and list(pool.free)[-1] == blk.block_id
    assert pool.lookup(42) is blk  # keeps its hash while free
    pool.check_invariants()


def test_a_second_block_of_the_same_content_is_cached_too_and_found_once_the_first_goes():
    """As vLLM's BlockHashToBlockMap: the same content computed twice is cached twice, a lookup
    finds the older block, and evicting it leaves the younger one to hit (before, the second
    stayed unhashed and its content was lost with the first: sim/mechanics.py's thrash phase
    hit 32-192 tokens fewer than vLLM)."""
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, 5)
    pool.cache_block(y, 5)
    assert pool.lookup(5) is x and y.block_hash == 5
    pool.cache_block(x, 6)  # a hashed block is never re-hashed
    assert x.block_hash == 5 and pool.lookup(6) is None
    pool.free_blocks([x, y])  # x first: x is evicted first (after the never-used block 3)
    pool.check_invariants()
    z, w = pool.get_new_blocks(2)
    assert (z.block_id, w) == (3, x) and x.block_hash is None
    assert pool.lookup(5) is y
    pool.check_invariants()


def test_a_freed_uncached_block_is_reused_first_and_a_cached_one_last():
    """vLLM 0.32's BlockPool.free_blocks: a block without a hash (a request's partial last
    block) goes to the head of the free queue, a hashed one to the tail (LRU)."""
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 7)
    pool.free_blocks([c, a, b])  # tail first, as a request frees
    assert list(pool.free) == [c.block_id, b.block_id, 4, a.block_id]
    assert pool.get_new_blocks(1) == [c]
    pool.check_invariants()


# -- random operations against a reference model -----------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "hit", "cache", "dup"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=60)


@settings(deadline=None, derandomize=True, max_examples=80)
@given(ops=ops)
def test_random_operations_keep_the_pool_consistent_with_a_model(ops):
    """A plain-list model of vLLM's pool: FIFO free list, ref counts, hash → blocks (a lookup
    finds the oldest block still cached under the hash)."""
    n = 9
    pool = BlockPool(n)
    free = list(range(1, n))  # model: head first
    ref = {i: 0 for i in range(1, n)}
    hashes: dict[int, int] = {}  # block → hash (model)

    def first_under(h: int) -> int | None:
        return next((bid for bid, hh in hashes.items() if hh == h), None)

    held: list[int] = []  # block ids held, with multiplicity (one entry per reference)
    next_hash = 1
    for op, r in ops:
        if op == "alloc":
            k = r % 3 + 1
            if k > len(free):
                with pytest.raises(RuntimeError):
                    pool.get_new_blocks(k)
                continue
            got = [b.block_id for b in pool.get_new_blocks(k)]
            assert got == free[:k]
            for bid in got:
                free.remove(bid)
                h = hashes.pop(bid, None)
                if h is not None:
                    blk = pool.lookup(h)
                    assert (blk.block_id if blk else None) == first_under(h)
                ref[bid] = 1
                held.append(bid)
        elif op == "free" and held:
            bid = held.pop(r % len(held))
            pool.free_blocks([pool.blocks[bid]])
            ref[bid] -= 1
            if ref[bid] == 0:  # cached: LRU at the tail; uncached: reused first
                free.append(bid) if bid in hashes else free.insert(0, bid)
        elif op == "hit" and hashes:
            bid = first_under(sorted(hashes.values())[r % len(hashes)])
            blk = pool.lookup(hashes[bid])
            assert blk is pool.blocks[bid]
            pool.touch([blk])
            if ref[bid] == 0:
                free.remove(bid)
            ref[bid] += 1
            held.append(bid)
        elif op == "cache" and held:
            bid = held[r % len(held)]
            if bid not in hashes:
                pool.cache_block(pool.blocks[bid], next_hash)
                hashes[bid] = next_hash
                next_hash += 1
        elif op == "dup" and held and hashes:
            bid = held[r % len(held)]
            if bid not in hashes:  # the same content as a cached block, computed again
                h = sorted(hashes.values())[r % len(hashes)]
                pool.cache_block(pool.blocks[bid], h)
                hashes[bid] = h
        pool.check_invariants()
        assert list(pool.free) == free
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == ref
        assert {bid: b.block_hash for bid, b in enumerate(pool.blocks) if b.block_hash is not None} == hashes
        assert pool.usage() == pytest.approx(1 - len(free) / (n - 1))
