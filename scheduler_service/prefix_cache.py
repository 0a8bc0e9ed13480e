"""Chained prefix hashes of a request's full KV blocks (the hashing itself lives in
services/prefix_hash.py, shared with the gateway's prefix-affinity router)."""

from __future__ import annotations

from scheduler_service.request import Request
from services.prefix_hash import (
    ROOT_HASH,
    block_extra_keys,
    extend_block_hashes,
    hash_block_tokens,
    lora_key,
)

__all__ = ["ROOT_HASH", "block_extra_keys", "hash_block_tokens", "update_block_hashes"]


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of its tokens; returns it."""
    return extend_block_hashes(
        request.block_hashes,
        request.all_token_ids,
        block_size,
        request.mm_inputs,
        request.cache_salt,
        lora_key(request.lora_request),
    )
