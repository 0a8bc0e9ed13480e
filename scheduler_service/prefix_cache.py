"""Chained prefix hashes of full KV blocks.

The hash of block i covers everything that decides its KV: the hash of block
i-1 (so equal hashes mean equal whole prefixes), the block's token ids, and
extra keys — the content hashes of multimodal items whose placeholder tokens
overlap the block (the same placeholder ids can stand for different images),
and the request's cache_salt on the first block (tenants never share).

SHA-256 over a compact byte encoding: stable across processes (a gateway may
route by it) and collision-safe, at about a microsecond per block.
"""

from __future__ import annotations

import functools
import hashlib
import struct

from scheduler_service.request import Request
from services.types import MultiModalInput

ROOT_HASH = b"tessera-prefix-v1"


def hash_block_tokens(
    parent_hash: bytes, token_ids: list[int], extra_keys: tuple[str, ...]
) -> bytes:
    """The prefix hash of one full block, given the hash of the block before it."""
    h = hashlib.sha256(parent_hash)
    h.update(_packer(len(token_ids)).pack(*token_ids))
    for key in extra_keys:
        h.update(b"\x00")
        h.update(key.encode())
    return h.digest()


@functools.cache
def _packer(n: int) -> struct.Struct:
    """Little-endian int64 packing of n token ids (struct beats array here)."""
    return struct.Struct(f"<{n}q")


def block_extra_keys(
    start: int, end: int, mm_inputs: list[MultiModalInput], cache_salt: str
) -> tuple[str, ...]:
    """Extra hash keys of the block holding tokens [start, end)."""
    keys = [f"salt:{cache_salt}"] if start == 0 and cache_salt else []
    for item in mm_inputs:
        if item.offset < end and item.offset + item.length > start:
            keys.append(f"mm:{item.content_hash}")
    return tuple(keys)


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of its tokens; returns it."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    tokens = request.all_token_ids
    while len(hashes) < num_full:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        extra = (
            block_extra_keys(start, end, request.mm_inputs, request.cache_salt)
            if request.mm_inputs or (i == 0 and request.cache_salt)
            else ()
        )
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, tokens[start:end], extra))
    return hashes
