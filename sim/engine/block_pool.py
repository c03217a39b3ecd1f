"""Paged KV blocks with prefix caching, after vLLM v1's BlockPool.

Invariants (checked by `check_invariants`, asserted by the tests after every step):
- a block is in the free queue  ⇔  its ref_cnt == 0;
- a block with a hash is the one `cached[hash]` maps to, or one of `duplicates[hash]`: as in
  vLLM, a request that computes content already cached elsewhere (its prefix lookup stopped at
  an earlier block) caches its own block under the same hash, and a lookup returns the oldest
  one still cached, so evicting the first leaves the second to hit (sim/mechanics.py measures
  what that is worth under thrash);
- freed blocks keep their hash until they are handed out again (that is what lets a finished
  request's KV be hit later); allocation takes from the head of the free queue (least recently
  freed) and evicts that block's hash; a freed cached block goes to the tail, a freed uncached
  one to the head (reused first).
- block 0 is vLLM's null block: never allocated, not counted in usage.
"""

from __future__ import annotations

from collections import OrderedDict

ROOT_HASH = 0x5F3759DF  # parent "hash" of a sequence's first block (vLLM's NONE_HASH)


def hash_block(parent: int, tokens: tuple[int, ...]) -> int:
    """Chained block hash: equal iff the whole prefix up to and including this block is equal
    (modulo 64-bit collisions). Python's tuple-of-int hash is unsalted, so it is deterministic."""
    return hash((parent, tokens))


def chain_hashes(token_ids: list[int], block_size: int, parent: int = ROOT_HASH, start_block: int = 0,
                 stop_block: int | None = None) -> list[int]:
    """Hashes of the full blocks [start_block, stop_block) of `token_ids`, chained from `parent`."""
    n_full = len(token_ids) // block_size
    stop = n_full if stop_block is None else min(stop_block, n_full)
    out = []
    h = parent
    for i in range(start_block, stop):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests holding this block; 0 ⇔ in the free queue
        self.block_hash: int | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks: need at least 2, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        # LRU free queue: first = next to hand out (evict), last = most recently freed.
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, Block] = {}  # hash -> the block a lookup finds
        self.duplicates: dict[int, dict[int, Block]] = {}  # hash -> later blocks, by id
        self.evictions = 0  # cached blocks whose hash was dropped on reuse
        # A memo of one prefix lookup (KVCacheManager) depends on the blocks with these hashes:
        # any change to whether they are cached or free sets `watch_dirty`.
        self.watched: frozenset[int] | set[int] = frozenset()
        self.watch_dirty = True

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: 1 − free / (total − null block)."""
        return 1.0 - len(self.free) / (self.num_gpu_blocks - 1)

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits; a hit on a free block pulls it out of the queue."""
        free = self.free
        watched = self.watched
        for b in blocks:
            if b.ref_cnt == 0:
                del free[b.block_id]
                if watched and b.block_hash in watched:
                    self.watch_dirty = True
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise RuntimeError(f"get_new_blocks({n}) with only {len(self.free)} free")  # a caller bug
        popitem = self.free.popitem
        out = [popitem(last=False)[1] for _ in range(n)]
        cached = self.cached
        duplicates = self.duplicates
        watched = self.watched
        for b in out:
            h = b.block_hash
            if h is not None:
                if duplicates:
                    self._uncache(h, b)
                else:  # no duplicates anywhere: every hashed block is the one lookups find
                    del cached[h]
                self.evictions += 1
                if watched and h in watched:
                    self.watch_dirty = True
                b.block_hash = None
            b.ref_cnt = 1
        return out

    def _uncache(self, h: int, b: Block) -> None:
        """Drop `b` from the blocks cached under `h`; the oldest duplicate, if any, becomes
        the one lookups find (vLLM's BlockHashToBlockMap keeps insertion order)."""
        dupes = self.duplicates.get(h)
        if self.cached.get(h) is b:
            if dupes:
                first = next(iter(dupes))
                self.cached[h] = dupes.pop(first)
                if not dupes:
                    del self.duplicates[h]
            else:
                del self.cached[h]
        elif dupes is not None:
            dupes.pop(b.block_id, None)
            if not dupes:
                del self.duplicates[h]

    def free_blocks(self, ordered: list[Block]) -> None:
        """Drop one reference from each. As in vLLM 0.32's BlockPool.free_blocks, blocks
        reaching 0 join the queue in the given order, a cached (hashed) block at the tail, an
        uncached one (a partial last block: no later request can hit it) at the head, to be
        reused first. Callers pass a request's blocks tail-first, so its last cached blocks are
        evicted first."""
        free = self.free
        watched = self.watched
        first: list[Block] = []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    first.append(b)
                    continue
                free[b.block_id] = b
                if watched and b.block_hash in watched:
                    self.watch_dirty = True
        for b in reversed(first):
            free[b.block_id] = b
            free.move_to_end(b.block_id, last=False)

    def cache_block(self, block: Block, block_hash: int) -> None:
        self.cache_blocks([block], [block_hash])

    def cache_blocks(self, blocks: list[Block], hashes: list[int]) -> None:
        """Give each block (not hashed yet) its hash: the one lookups find if none is cached
        under it, else a duplicate (the hot path of prefill and free)."""
        cached = self.cached
        watched = self.watched
        for block, h in zip(blocks, hashes):
            if block.block_hash is not None:
                continue
            block.block_hash = h
            if h not in cached:
                cached[h] = block
                if watched and h in watched:
                    self.watch_dirty = True
            else:
                self.duplicates.setdefault(h, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, as vLLM's reset_prefix_cache: only when no request
        holds a block (returns False and changes nothing otherwise)."""
        if len(self.free) != self.num_gpu_blocks - 1:
            return False
        for b in self.cached.values():
            b.block_hash = None
        for dupes in self.duplicates.values():
            for b in dupes.values():
                b.block_hash = None
        self.cached.clear()
        self.duplicates.clear()
        self.watch_dirty = True
        return True

    def check_invariants(self) -> None:
        for b in self.blocks[1:]:
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in self.free), b
            if b.block_hash is not None:
                assert (self.cached.get(b.block_hash) is b
                        or self.duplicates.get(b.block_hash, {}).get(b.block_id) is b), b
        for h, b in self.cached.items():
            assert b.block_hash == h, (h, b)
        for h, dupes in self.duplicates.items():
            assert dupes and h in self.cached, h
            assert all(b.block_hash == h and b is not self.cached[h] for b in dupes.values()), h
        assert self.null_block.block_id not in self.free
