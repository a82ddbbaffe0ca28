"""KV block pool with automatic prefix caching: which paged-KV-cache blocks each request holds.

The Scheduler allocates blocks here; their ids travel in SchedulerOutput to the worker's cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from loomllm.core.request import Request

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained to the hash of the block before it (b"" for the first).

    The chain makes a block match only after the same prefix. sha256, not Python's hash():
    that 64-bit hash can be made to collide, handing one request another's KV (CVE-2025-25183).
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockPool:
    """Ref-counted blocks, a free queue in LRU order, and the prefix cache (hash -> block)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Free blocks, least recently freed first: allocation pops the head, free appends
        # to the tail, and a cache hit removes a block from the middle (O(1) here).
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take blocks from the head of the free queue; a cached one loses its hash."""
        assert num_blocks <= len(self.free_block_queue), "caller checks num_free_blocks"
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self.free_block_queue.popitem(last=False)
            assert self.ref_cnt[block_id] == 0
            self.evict(block_id)
            self.ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (prefix-cache hits); free ones leave the free queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_block_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """One holder less; blocks nobody holds join the free queue's tail in the given order.

        A freed block keeps its hash, so the prefix cache finds it until it is reused.
        """
        for block_id in ordered_block_ids:
            assert self.ref_cnt[block_id] > 0, f"block {block_id} freed twice"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_block_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full block findable; if an equal block is already cached, that one stays."""
        if self.block_hashes[block_id] is not None or block_hash in self.cached_block_hash_to_block:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_block_hash_to_block[block_hash] = block_id

    def evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_block_hash_to_block[block_hash]
            self.block_hashes[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        return True


class KVCacheManager:
    """Per-request block tables over a BlockPool: prefix-cache lookup, allocation, free."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up, once per (re)admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # -- stats -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Share of blocks held by requests, 0..1 (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    # -- allocation ------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of a new request, and how many tokens they cover.

        Full blocks only, and never the whole prompt: at most `num_tokens - 1` tokens, so
        the step still computes one token and gets its logits. Changes nothing. A request
        asking for prompt logprobs finds none (vLLM's rule): every prompt position must be
        computed to get its logits. Its own full blocks are still cached for others.
        """
        if not self._can_read_cache(request):
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._block_hashes(request, max_hit_blocks)[:max_hit_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Room for `num_new_tokens` more tokens after the computed ones; None if it won't fit.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (a new
        request only): they join the request's blocks and are ref-counted. Returns the
        newly allocated block ids. On None nothing changed. Full blocks, including those
        this step will fill, become findable in the prefix cache (vLLM's rule: a later
        request may share them as soon as their KV is scheduled to be written).
        """
        rid = request.request_id
        pool = self.block_pool
        req_blocks = self.req_to_blocks.get(rid)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        num_required = -(-num_tokens // self.block_size) - num_held - len(new_computed_blocks)
        num_required = max(num_required, 0)
        # Hits that sit in the free queue leave it, so they count against the free blocks.
        num_free_hits = sum(1 for b in new_computed_blocks if pool.ref_cnt[b] == 0)
        if num_required + num_free_hits > pool.num_free_blocks:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            if self._can_read_cache(request):  # the hit rate counts lookups only
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        # Most decode steps have room left in the last block: nothing to take or extend.
        new_blocks = pool.get_new_blocks(num_required) if num_required else []
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            # Placeholder tokens have no id yet, so only blocks of known tokens get a hash.
            num_full = min(num_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, req_blocks, num_full)
        return new_blocks

    def _can_read_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so that the tail is evicted first."""
        rid = request.request_id
        self._req_to_block_hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def forget_unwritten(self, request: Request) -> None:
        """Make the request's blocks past `num_computed_tokens` unfindable; call before free().

        Their allocation cached hashes for KV that a step was to write, but the request left
        that step before it was sent."""
        pool = self.block_pool
        first = request.num_computed_tokens // self.block_size
        for block_id in self.req_to_blocks.get(request.request_id, ())[first:]:
            if pool.ref_cnt[block_id] == 1:  # its own, not a hit another request holds
                pool.evict(block_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (block i holds tokens i*block_size...)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (e.g. after a failed step left KV unwritten).

        Only possible while no request holds blocks; returns whether it happened.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        self._req_to_block_hashes.clear()
        self._num_cached_blocks.clear()
        return True

    # -- hashing ---------------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained block hashes, memoized, extended to at least `num_blocks`."""
        hashes = self._req_to_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            # A LoRA request's KV is its adapter's: its chain starts from the adapter's id.
            first = b"" if request.lora is None else b"lora:%d" % request.lora.lora_int_id
            parent = hashes[-1] if hashes else first
            hashes.append(hash_block_tokens(parent, tokens[start : start + size]))
        return hashes

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_full: int) -> None:
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = num_full
