"""The paged KV block pool: blocks, an O(1) LRU free list, and the prefix-hash index.

A block is free when its ref count is 0. Free blocks sit in `FreeBlockQueue`
in eviction order: blocks holding no cached prefix first, then cached blocks
from least to most recently freed. A free cached block keeps its hash (and its
entry in the hash index) until the pool hands it out again, so a later prefix
hit can revive it; only then is the hash evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V pools.

    `block_hash` is write-once while the block is cached: set when the block's
    tokens are computed and registered, cleared only when the block is evicted.
    `prev_free` / `next_free` link the block into the free queue (None when not free).
    """

    __slots__ = ("_block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    def set_hash(self, block_hash: bytes) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a hash")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self._block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks; every operation is O(1).

    The front is evicted first. Two sentinels bound the list so that no
    operation needs a special case for the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` last in eviction order (most recently used)."""
        self._link(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` first in eviction order."""
        self._link(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already free")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All `num_blocks` blocks, the free queue and the hash -> cached block index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks (evicting their cached hashes), each with ref count 1."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        taken = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None:
            if self.cached.get(block_hash) is block:
                del self.cached[block_hash]
            block.reset_hash()

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (reviving free cached ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, given in eviction order (evict-first first).

        A block reaching ref count 0 joins the free queue: at the front when it
        holds no cached prefix (nothing to lose), at the back when it does.
        """
        uncached: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_queue.append(block)
        for block in reversed(uncached):
            self.free_queue.appendleft(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a computed full block under its prefix hash.

        Returns False (and leaves the block uncached) when another block already
        holds that prefix or this block is already cached.
        """
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.set_hash(block_hash)
        self.cached[block_hash] = block
        return True

    def usage(self) -> float:
        """Fraction of blocks owned by requests."""
        return self.num_used_blocks / self.num_blocks
