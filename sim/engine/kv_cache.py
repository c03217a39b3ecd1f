"""Per-request KV allocation on top of the block pool, after vLLM v1's KVCacheManager."""

from __future__ import annotations

from operator import attrgetter

from sim.engine.block_pool import ROOT_HASH, Block, BlockPool, chain_hashes
from sim.engine.request import EngineRequest

_REF_CNT = attrgetter("ref_cnt")


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._memo_req: EngineRequest | None = None  # see get_computed_blocks
        self._memo_hits: list[Block] = []
        self._memo_evictable = 0
        self._memo_watch: set[int] = set()  # the memo's chain, as the pool's watch set

    # -- hashing -------------------------------------------------------------------------
    def extend_block_hashes(self, req: EngineRequest, upto_tokens: int) -> None:
        """Make req.block_hashes cover every full block among its first `upto_tokens` tokens."""
        bs = self.block_size
        have = len(req.block_hashes)
        want = upto_tokens // bs
        if want <= have:
            return
        tokens = req.prompt_token_ids if want * bs <= req.num_prompt_tokens else req.all_token_ids()
        parent = req.block_hashes[-1] if have else ROOT_HASH ^ req.lora_seed
        req.block_hashes.extend(chain_hashes(tokens, bs, parent, have, want))

    # -- lookup and allocation -----------------------------------------------------------
    def get_computed_blocks(self, req: EngineRequest) -> list[Block]:
        """Longest run of cached full blocks from the start, capped at num_tokens − 1 tokens
        (the last token is always recomputed to get logits)."""
        pool = self.pool
        if req is self._memo_req and not pool.watch_dirty:
            return self._memo_hits
        max_blocks = (req.num_tokens - 1) // self.block_size
        self.extend_block_hashes(req, max_blocks * self.block_size)
        chain = req.block_hashes[:max_blocks]
        hits: list[Block] = list(map(pool.cached.get, chain))  # one C-level pass over the chain
        try:
            del hits[hits.index(None):]  # the hit is the run of cached blocks from the start
        except ValueError:
            pass
        # Memo for the (usually blocked) head of the waiting queue, which the scheduler probes
        # at every step: valid until a block of its chain changes cached or free state.
        self._memo_evictable = list(map(_REF_CNT, hits)).count(0)
        if req is not self._memo_req or len(chain) != len(self._memo_watch):
            self._memo_watch = set(chain)  # the same request probed again: same chain, same set
        self._memo_req, self._memo_hits = req, hits
        pool.watched, pool.watch_dirty = self._memo_watch, False
        return hits

    def blocks_to_allocate(self, req: EngineRequest, num_new_tokens: int,
                           computed: list[Block] = ()) -> tuple[int, int]:
        """(new blocks to take from the free queue, free-queue blocks the hits will pull out)."""
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        slots = min(num_computed + num_new_tokens, self.max_model_len)
        n_new = max(0, -(-slots // self.block_size) - len(req.blocks) - len(computed))
        if computed is self._memo_hits and not self.pool.watch_dirty:
            evictable = self._memo_evictable
        else:
            evictable = list(map(_REF_CNT, computed)).count(0)
        return n_new, evictable

    def can_allocate(self, req: EngineRequest, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        n_new, evictable = self.blocks_to_allocate(req, num_new_tokens, computed)
        return n_new + evictable <= self.pool.num_free

    def allocate_slots(self, req: EngineRequest, num_new_tokens: int,
                       computed: list[Block] = ()) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (after taking `computed` hits).
        Returns False — and changes nothing — when the free queue is too short."""
        n_new, evictable = self.blocks_to_allocate(req, num_new_tokens, computed)
        if n_new + evictable > self.pool.num_free:
            return False
        if computed:
            self.pool.touch(computed)
            req.blocks.extend(computed)
            req.num_cached_blocks = len(req.blocks)
        if n_new:
            req.blocks.extend(self.pool.get_new_blocks(n_new))
        # Prompt blocks are cached as soon as they are scheduled (vLLM caches at allocation,
        # so a request scheduled later in the same step already hits them). Output blocks are
        # cached when the request frees them (see `free`): nothing else can hit them earlier.
        num_prompt_cached = min(req.num_computed_tokens + len(computed) * self.block_size
                                + num_new_tokens, req.num_prompt_tokens)
        self._cache_full_blocks(req, num_prompt_cached // self.block_size)
        return True

    def _cache_full_blocks(self, req: EngineRequest, n_full: int) -> None:
        if n_full <= req.num_cached_blocks:
            return
        self.extend_block_hashes(req, n_full * self.block_size)
        start = req.num_cached_blocks
        self.pool.cache_blocks(req.blocks[start:n_full], req.block_hashes[start:n_full])
        req.num_cached_blocks = n_full

    def free(self, req: EngineRequest) -> None:
        """Release the request's blocks, tail first, after caching every computed full block
        (so a recompute after preemption, or the next turn of a conversation, can hit them)."""
        self._cache_full_blocks(req, min(req.num_computed_tokens // self.block_size, len(req.blocks)))
        self.pool.free_blocks(req.blocks[::-1])
        req.blocks = []
        req.num_cached_blocks = 0
