"""The free-block queue and the pool: O(1) list operations, LRU eviction, write-once hashes."""

from __future__ import annotations

import pytest

from scheduler_service.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_removes_from_the_middle_and_both_ends() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3] and len(queue) == 2
    queue.appendleft(blocks[4])
    queue.append(blocks[0])
    assert ids(queue) == [4, 1, 3, 0]
    assert queue.popleft() is blocks[4]
    assert blocks[4].prev_free is None and blocks[4].next_free is None


def test_free_queue_refuses_double_insert_and_foreign_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_hash_is_write_once() -> None:
    block = KVCacheBlock(0)
    block.set_hash(b"a")
    with pytest.raises(RuntimeError):
        block.set_hash(b"b")
    block.reset_hash()
    block.set_hash(b"b")
    assert block.block_hash == b"b"


def test_lru_eviction_order() -> None:
    """Uncached free blocks go first; cached ones are evicted least recently freed first."""
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    for block, h in ((b0, b"h0"), (b1, b"h1"), (b2, b"h2")):
        assert pool.cache_block(block, h)
    pool.free_blocks([b1])
    pool.free_blocks([b0])
    pool.free_blocks([b3])  # holds no cached prefix
    pool.free_blocks([b2])
    assert ids(pool.free_queue) == [3, 1, 0, 2]
    assert pool.get_new_blocks(1) == [b3]  # costs no cached prefix
    assert set(pool.cached) == {b"h0", b"h1", b"h2"}
    assert pool.get_new_blocks(1) == [b1]  # least recently freed cached block
    assert set(pool.cached) == {b"h0", b"h2"} and b1.block_hash is None
    hit = pool.get_cached_block(b"h0")
    assert hit is b0
    pool.touch([b0])  # a prefix hit revives it from the middle of the queue
    assert b0.ref_cnt == 1 and ids(pool.free_queue) == [2]
    assert pool.get_new_blocks(1) == [b2]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4


def test_free_order_puts_tail_blocks_first() -> None:
    """A request's blocks are freed tail first, so its last blocks are evicted first."""
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]))
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_queue) == [2, 1, 0]


def test_shared_block_is_free_only_when_every_owner_freed_it() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_duplicate_prefix_is_not_cached_twice() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"same")
    assert not pool.cache_block(b, b"same")
    assert b.block_hash is None and pool.get_cached_block(b"same") is a
