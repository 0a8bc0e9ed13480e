"""Invalid configurations fail at construction with a message naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.config import (
    CacheConfig,
    GatewayConfig,
    ModelConfig,
    SchedulerConfig,
    WorkerConfig,
    parse_bytes,
)
from services.types import SamplingParams, SharedMemoryLocation, TensorHandle

INVALID: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
    (ModelConfig, {"model": ""}, "model"),
    (ModelConfig, {"dtype": "int8"}, "dtype"),
    (ModelConfig, {"max_model_len": -1}, "max_model_len"),
    (ModelConfig, {"device": "tpu"}, "device"),
    (CacheConfig, {"block_size": 3}, "block_size"),
    (CacheConfig, {"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
    (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    (CacheConfig, {"num_blocks_override": -2}, "num_blocks_override"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
    (SchedulerConfig, {"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    (SchedulerConfig, {"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    (SchedulerConfig, {"policy": "random"}, "policy"),
    (WorkerConfig, {"attention_backend": "flash"}, "attention backend"),
    (WorkerConfig, {"num_threads": -1}, "num_threads"),
    (GatewayConfig, {"scheduler_address": "nohost"}, "scheduler_address"),
    (GatewayConfig, {"port": 70000}, "port"),
    (GatewayConfig, {"max_queued_requests": 0}, "max_queued_requests"),
    (SamplingParams, {"temperature": -1.0}, "temperature"),
    (SamplingParams, {"top_p": 0.0}, "top_p"),
    (SamplingParams, {"top_k": -2}, "top_k"),
    (SamplingParams, {"min_p": 2.0}, "min_p"),
    (SamplingParams, {"max_tokens": 0}, "max_tokens"),
    (SamplingParams, {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (SamplingParams, {"presence_penalty": 3.0}, "presence_penalty"),
    (SamplingParams, {"repetition_penalty": 0.0}, "repetition_penalty"),
    (SamplingParams, {"logprobs": 21}, "logprobs"),
    (SamplingParams, {"logit_bias": {-1: 1.0}}, "logit_bias"),
    (SamplingParams, {"logit_bias": {3: 101.0}}, "logit_bias"),
    (SamplingParams, {"stop_token_ids": (-5,)}, "stop_token_ids"),
]


@pytest.mark.parametrize(("cls", "kwargs", "field"), INVALID, ids=lambda v: str(v)[:40])
def test_invalid_config_names_the_field(
    cls: Callable[..., Any], kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_defaults_are_valid_and_frozen() -> None:
    config = WorkerConfig()
    assert config.cache.block_size == 16 and config.model.dtype == "bfloat16"
    with pytest.raises(AttributeError):
        config.num_threads = 3  # type: ignore[misc]


def test_tensor_handle_needs_exactly_one_location() -> None:
    with pytest.raises(ValueError, match="exactly one location"):
        TensorHandle(dtype="uint8", shape=(1,))
    with pytest.raises(ValueError, match="exactly one location"):
        TensorHandle(
            dtype="uint8",
            shape=(1,),
            inline_bytes=b"x",
            shared_memory=SharedMemoryLocation(name="x", offset=0, nbytes=1),
        )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("2G", 2_000_000_000),
        ("4", 4 << 30),
        ("1073741824", 1 << 30),
        ("1.5GiB", 3 << 29),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="as a size"):
        parse_bytes("lots")
