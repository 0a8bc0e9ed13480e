"""Chained prefix hashes of full KV blocks: the one implementation the scheduler's prefix
cache and the gateway's prefix-affinity router share.

The hash of block i covers everything that decides its KV: the hash of block
i-1 (so equal hashes mean equal whole prefixes), the block's token ids, and
extra keys — the content hashes of multimodal items whose placeholder tokens
overlap the block (the same placeholder ids can stand for different images),
the request's cache_salt on the first block (tenants never share), and its LoRA
adapter on the first block (the chain carries it on: different adapters never share KV).

SHA-256 over a compact byte encoding: stable across processes (a gateway may
route by it) and collision-safe, at about a microsecond per block.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

from services.types import LoRARequest, MultiModalInput

ROOT_HASH = b"tessera-prefix-v1"


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple[str, ...]
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


def lora_key(lora_request: LoRARequest | None) -> str:
    """The prefix-hash key of a request's adapter; empty for the base model."""
    if lora_request is None:
        return ""
    return f"{lora_request.lora_int_id}:{lora_request.lora_name}"


def block_extra_keys(
    start: int,
    end: int,
    mm_inputs: Sequence[MultiModalInput],
    cache_salt: str,
    lora: str = "",
) -> tuple[str, ...]:
    """Extra hash keys of the block holding tokens [start, end)."""
    keys = [f"salt:{cache_salt}"] if start == 0 and cache_salt else []
    if start == 0 and lora:
        keys.append(f"lora:{lora}")
    for item in mm_inputs:
        if item.offset < end and item.offset + item.length > start:
            keys.append(f"mm:{item.content_hash}")
    return tuple(keys)


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str = "",
    lora: str = "",
    max_blocks: int | None = None,
) -> list[bytes]:
    """Append to `hashes` the hash of every further full block of `token_ids` (at most
    `max_blocks` in all); returns `hashes`."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    while len(hashes) < num_full:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        extra = (
            block_extra_keys(start, end, mm_inputs, cache_salt, lora)
            if mm_inputs or (i == 0 and (cache_salt or lora))
            else ()
        )
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, token_ids[start:end], extra))
    return hashes
