"""KV cache manager: prefix hits (full blocks only, capped at n − 1), caching at allocation and
on free, freed blocks hitting until they are reused, all-or-nothing allocation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.kv_cache import KVCacheManager
from sim.engine.request import EngineRequest

BS = 16


def _req(rid: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens=8)


def _prefill(kv: KVCacheManager, req: EngineRequest) -> int:
    """Admit `req` as the scheduler does (hits, then one chunk for the rest); return hit tokens."""
    hits = kv.get_computed_blocks(req)
    n_hit = len(hits) * BS
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    req.num_computed_tokens = req.num_tokens
    return n_hit


@settings(deadline=None, derandomize=True, max_examples=40)
@given(k=st.integers(1, 6), extra=st.integers(0, 15))
def test_repeat_hits_every_full_block_but_the_token_before_the_last(k, extra):
    n = k * BS + extra
    prompt = list(range(1, n + 1))
    kv = KVCacheManager(32, BS, 4096)
    first = _req("a", prompt)
    assert _prefill(kv, first) == 0
    # A hit covers at most n − 1 tokens: with n = k·16 the last block is recomputed.
    expected = (k - 1) * BS if extra == 0 else k * BS
    assert _prefill(kv, _req("b", prompt)) == expected
    # …while a longer prompt with the same start hits all k blocks.
    assert _prefill(kv, _req("c", prompt + [999])) == k * BS
    kv.pool.check_invariants()


def test_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(32, BS, 4096)
    base = list(range(100, 164))  # 4 blocks
    _prefill(kv, _req("a", base))
    other = base[:40] + [1] + base[41:]  # token 40 lies in block 2
    assert _prefill(kv, _req("b", other + [7])) == 2 * BS


def test_freed_blocks_hit_until_reused_then_miss():
    kv = KVCacheManager(6, BS, 4096)  # 5 usable blocks
    a = _req("a", list(range(1, 34)))  # 33 tokens: 2 full blocks + 1 partial
    _prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 5
    # Freed tail-first: the partial block 3 (no hash) goes to the head, to be reused first;
    # the cached 2 then 1 to the tail.
    assert list(kv.pool.free) == [3, 4, 5, 2, 1]
    b = _req("b", list(range(1, 34)))
    assert _prefill(kv, b) == 32  # both full blocks hit while free
    kv.free(b)
    # Fill the pool with unrelated requests: the LRU head goes first.
    # Free queue now (head first): 3 (b's partial, reused from a), 4, 5, 2, 1.
    assert list(kv.pool.free) == [3, 4, 5, 2, 1]
    c = _req("c", list(range(500, 500 + 3 * BS)))  # takes 3, 4, 5: no hash evicted
    _prefill(kv, c)
    assert kv.pool.lookup(b.block_hashes[0]) is not None  # still cached
    d = _req("d", list(range(700, 700 + BS)))  # takes block 2: evicts a's second block
    _prefill(kv, d)
    e = _req("e", list(range(1, 34)))
    assert [b.block_id for b in kv.get_computed_blocks(e)] == [1]  # only the first block survived
    assert kv.pool.evictions == 1


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(4, BS, 4096)  # 3 usable blocks
    a = _req("a", list(range(1, 33)))
    _prefill(kv, a)
    kv.free(a)  # blocks 2, 1 free and cached; 3 free
    big = _req("b", list(range(1, 33)) + list(range(40, 80)))  # 72 tokens → 5 blocks
    hits = kv.get_computed_blocks(big)
    assert len(hits) == 2
    before = (list(kv.pool.free), dict(kv.pool.cached))
    assert not kv.can_allocate(big, big.num_tokens - 32, hits)
    assert not kv.allocate_slots(big, big.num_tokens - 32, hits)
    assert (list(kv.pool.free), dict(kv.pool.cached)) == before and big.blocks == []
    # A chunk that fits: 2 hit blocks (pulled from the free queue) + 1 new = 3 ≤ 3 free.
    assert kv.allocate_slots(big, 16, hits)
    assert [b.block_id for b in big.blocks[:2]] == [h.block_id for h in hits] and kv.pool.num_free == 0


def test_prompt_blocks_are_cached_at_allocation_output_blocks_on_free():
    kv = KVCacheManager(16, BS, 4096)
    r = _req("r", list(range(1, 41)))  # 40 tokens: 2 full prompt blocks
    assert kv.allocate_slots(r, 20)  # first chunk: 20 tokens → 1 full block
    r.num_computed_tokens = 20
    assert r.num_cached_blocks == 1 and kv.pool.lookup(chain_of(r, 1)[0]) is r.blocks[0]
    assert kv.allocate_slots(r, 20)
    r.num_computed_tokens = 40
    assert r.num_cached_blocks == 2
    # Decode 30 output tokens: blocks grow, nothing new is cached until the request frees.
    for _ in range(30):
        r.num_output_tokens += 1
        r.num_tokens += 1
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert r.num_cached_blocks == 2 and len(kv.pool.cached) == 2
    kv.free(r)  # 70 computed tokens → 4 full blocks cached
    assert len(kv.pool.cached) == 4
    # A continuation (prompt = r's prompt + output, as a next turn) hits all 4.
    nxt = _req("n", r.all_token_ids() + [5, 6])
    assert _prefill(kv, nxt) == 4 * BS


def chain_of(req: EngineRequest, n: int) -> list[int]:
    from sim.engine.block_pool import chain_hashes

    return chain_hashes(req.prompt_token_ids, BS, stop_block=n)
