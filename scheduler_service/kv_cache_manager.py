"""Block tables of requests on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from scheduler_service.block_pool import BlockPool, KVCacheBlock
from scheduler_service.prefix_cache import update_block_hashes
from scheduler_service.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the blocks of requests.

    Contract: `request.block_ids` is only changed here. A block is registered
    in the prefix cache only after its tokens were computed (see
    `cache_computed_blocks`), so a failed step can never leave a hash that
    points at unwritten KV.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int = 0,
    ):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        # Every layer attends back over at most this many tokens (0: some layer attends to
        # all): leading blocks wholly before it are freed as a request advances, their ids
        # left in its table (positions stay put; the workers never read them again).
        self.sliding_window = sliding_window
        self._num_freed: dict[str, int] = {}  # request id -> leading blocks already freed
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least the last token is always left to compute (its logits are needed),
        so at most (num_tokens - 1) // block_size blocks match. Returns the blocks
        and the number of tokens they hold. Nothing is reserved yet. A request that
        asks for prompt logprobs reads no hits (as in vLLM): every prompt position's
        logits must be computed.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = update_block_hashes(request, self.block_size)
        hit: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Reserve blocks for `num_new_tokens` more tokens of `request` this step
        (after its computed tokens and those of a step still in flight).

        `new_computed_blocks` (admission only) are prefix-cache hits appended to
        the block table first. Returns the ids of newly taken blocks (possibly
        empty), or None — changing nothing — when the pool cannot provide them.
        """
        computed = request.num_computed_tokens + request.num_inflight_tokens  # incl. in flight
        fits_in_table = computed + num_new_tokens <= len(request.block_ids) * self.block_size
        if new_computed_blocks is None and fits_in_table:  # fast path: a decode token
            return []
        hits = new_computed_blocks or []
        num_tokens = computed + len(hits) * self.block_size + num_new_tokens
        num_new = cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(hits)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_new, 0) + num_revived > self.pool.num_free_blocks:
            return None
        if new_computed_blocks is not None:
            self._admit(request, hits)
        if num_new <= 0:
            return []
        new_ids = [b.block_id for b in self.pool.get_new_blocks(num_new)]
        request.block_ids.extend(new_ids)
        return new_ids

    def _admit(self, request: Request, hits: list[KVCacheBlock]) -> None:
        self.pool.touch(hits)
        request.block_ids.extend(b.block_id for b in hits)
        request.num_hashed_blocks = len(hits)
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hits) * self.block_size

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks under their prefix hashes."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_hashed_blocks:
            return
        hashes = update_block_hashes(request, self.block_size)
        blocks = self.pool.blocks
        for i in range(request.num_hashed_blocks, num_full):
            self.pool.cache_block(blocks[request.block_ids[i]], hashes[i])
        request.num_hashed_blocks = num_full

    def free_outside_window(self, request: Request) -> None:
        """Free the request's leading blocks that no future token can see: the next token
        (position num_computed_tokens) sees keys after num_computed_tokens - window."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(first_visible, 0) // self.block_size, len(request.block_ids))
        done = self._num_freed.get(request.request_id, 0)
        if num_out <= done:
            return
        blocks = self.pool.blocks
        self.pool.free_blocks([blocks[i] for i in request.block_ids[done:num_out]])
        self._num_freed[request.request_id] = num_out

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so tails are evicted first)."""
        blocks = self.pool.blocks
        done = self._num_freed.pop(request.request_id, 0) if self._num_freed else 0
        self.pool.free_blocks([blocks[i] for i in reversed(request.block_ids[done:])])
        request.block_ids = []
        request.num_hashed_blocks = 0
