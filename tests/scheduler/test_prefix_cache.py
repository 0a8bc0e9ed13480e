"""Chained prefix hashes: what changes a block's hash and what does not."""

from __future__ import annotations

from scheduler_service.prefix_cache import block_extra_keys, update_block_hashes
from scheduler_service.request import Request
from services.types import MultiModalInput, SamplingParams

PLACEHOLDER = 9


def hashes(
    prompt: list[int], *, salt: str = "", mm: list[MultiModalInput] | None = None
) -> list[bytes]:
    request = Request("r", prompt, SamplingParams(), 1024, cache_salt=salt, mm_inputs=mm)
    return update_block_hashes(request, 4)


def image(offset: int, length: int, content: str) -> MultiModalInput:
    return MultiModalInput("image", offset, length, content)


def test_hashes_cover_full_blocks_only_and_chain() -> None:
    a = hashes(list(range(10)))
    assert len(a) == 2  # 10 tokens = 2 full blocks + 2 tokens
    b = hashes([0, 1, 2, 3, 4, 5, 6, 99, 8, 9])
    assert a[0] == b[0] and a[1] != b[1]
    c = hashes([50, 1, 2, 3, 4, 5, 6, 7])
    assert c[1] != a[1]  # same tokens in block 1, different parent


def test_cache_salt_changes_every_block_through_the_chain() -> None:
    plain, salted, other = hashes([1] * 8), hashes([1] * 8, salt="t1"), hashes([1] * 8, salt="t2")
    assert len({plain[0], salted[0], other[0]}) == 3
    assert len({plain[1], salted[1], other[1]}) == 3
    assert block_extra_keys(4, 8, [], "t1") == ()  # the salt is keyed on the first block only


def test_multimodal_content_hash_keys_only_the_blocks_it_overlaps() -> None:
    prompt = [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 6, 7, 8, 9]
    cat = hashes(prompt, mm=[image(5, 3, "cat")])
    dog = hashes(prompt, mm=[image(5, 3, "dog")])
    assert cat[0] == dog[0]  # block 0 holds no placeholder
    assert cat[1] != dog[1] and cat[2] != dog[2]
    assert block_extra_keys(4, 8, [image(5, 3, "cat")], "") == ("mm:cat",)
    assert block_extra_keys(8, 12, [image(5, 3, "cat")], "") == ()


def test_hashes_extend_incrementally_as_tokens_arrive() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), 1024)
    assert update_block_hashes(request, 4) == []
    request.append_output_token(4)
    first = update_block_hashes(request, 4)
    assert len(first) == 1 and first[0] == hashes([1, 2, 3, 4])[0]
