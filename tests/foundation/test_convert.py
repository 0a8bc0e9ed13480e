"""Every domain object survives domain -> proto -> bytes -> proto -> domain with all fields set."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from google.protobuf.message import Message

from services import convert
from services.step_types import (
    CachedRequestData,
    DraftTokens,
    KVCacheSpec,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    PooledOutput,
    PromptLogprobs,
    SampledLogprobs,
    SchedulerOutput,
    SchedulerStats,
    ServerInfo,
    WorkerTimings,
)
from services.types import (
    CudaIpcLocation,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    RequestTimestamps,
    SamplingParams,
    SharedMemoryLocation,
    StructuredOutputParams,
    TensorHandle,
    TokenLogprobs,
)

PARAMS = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    max_tokens=64,
    min_tokens=2,
    stop_token_ids=(7, 9),
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    logit_bias={11: 2.5, 12: -100.0},
    logprobs=3,
    prompt_logprobs=1,
    structured_output=StructuredOutputParams(choice=("yes", "no")),
)
LOGPROBS = TokenLogprobs(
    token_id=5, logprob=-0.25, rank=2, top_token_ids=[4, 5], top_logprobs=[-0.125, -0.25]
)
CUDA = TensorHandle(
    dtype="bfloat16",
    shape=(3, 224, 224),
    cuda_ipc=CudaIpcLocation(
        device_index=1,
        ipc_memory_handle=b"\x01\x02",
        storage_size_bytes=4096,
        storage_offset_bytes=512,
        tensor_offset=8,
        stride=(50176, 224, 1),
        ref_counter_handle=b"ref",
        ref_counter_offset=16,
        event_handle=b"evt",
        event_sync_required=True,
    ),
)
SHM = TensorHandle(dtype="uint8", shape=(2, 2), shared_memory=SharedMemoryLocation("psm_1", 64, 4))
INLINE = TensorHandle(dtype="float32", shape=(1,), inline_bytes=b"\x00\x00\x80?")
MM = MultiModalInput(
    modality="image", offset=3, length=64, content_hash="abc", tensor=CUDA, grid_thw=[1, 8, 16]
)
LORA = LoRARequest("sql", 3, "/adapters/sql")

CASES: list[Any] = [
    PARAMS,
    CUDA,
    SHM,
    INLINE,
    MM,
    LORA,
    EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=PARAMS,
        arrival_time=1700000000.5,
        priority=-3,
        cache_salt="tenant-a",
        mm_inputs=[MM],
        pooling_params=PoolingParams(dimensions=32, normalize=False),
        lora_request=LORA,
        trace_headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    ),
    EngineCoreOutput(
        request_id="r1",
        new_token_ids=[5],
        new_logprobs=[LOGPROBS],
        finish_reason=FinishReason.STOP,
        stop_reason=7,
        num_cached_tokens=32,
        timestamps=RequestTimestamps(queued=1.5, scheduled=2.5, first_token=3.5),
        error="boom",
        prompt_logprobs=[LOGPROBS, LOGPROBS],
        pooling_output=b"\x00\x00\x80?",
    ),
    SchedulerOutput(
        step_id=9,
        scheduled_new_reqs=[
            NewRequestData(
                request_id="a",
                prompt_token_ids=[1, 2],
                output_token_ids=[3],
                sampling_params=PARAMS,
                block_ids=[4, 5],
                num_computed_tokens=16,
                mm_inputs=[MM],
                resumed_from_preemption=True,
                pooling_params=PoolingParams(dimensions=8, normalize=True),
                lora_request=LORA,
            )
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["b", "f"],
            num_computed_tokens=[17, 30],
            num_new_blocks=[1, 2],
            new_block_ids=[6, 12, 13],
        ),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids=["c"],
        preempted_req_ids=["d"],
        scheduled_spec_decode_tokens=[DraftTokens("b", [7, 8])],
        trace_contexts=["00-" + "1" * 32 + "-" + "2" * 16 + "-01"],
    ),
    ModelRunnerOutput(
        step_id=9,
        req_ids=["a", "b"],
        num_sampled=[1, 2],
        sampled_token_ids=[8, 9, 10],
        sampled_logprobs=[SampledLogprobs(request_id="b", logprobs=[LOGPROBS, LOGPROBS])],
        prompt_logprobs=[PromptLogprobs(request_id="a", start=1, logprobs=[LOGPROBS])],
        timings=WorkerTimings(prepare_ms=0.5, forward_ms=10.25, sample_ms=0.75, total_ms=11.5),
        request_errors={"e": "bad logit_bias"},
        error="step failed",
        pooler_output=[PooledOutput(request_id="p", data=b"\x00\x00\x80?")],
        draft_token_ids=[DraftTokens("b", [10, 11, 12])],
    ),
    ModelInfo(
        model_name="m",
        max_model_len=8192,
        vocab_size=49152,
        eos_token_ids=(2,),
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        device="cpu",
        instance_id="5f0c2a",
        host_id="h/boot",
        runner="pooling",
        pooling_type="MEAN",
    ),
    KVCacheSpec(
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        dtype="bfloat16",
        block_size=16,
        bytes_per_block=368640,
        sliding_window=32,
        length_dependent_rope=True,
        rope_recompute_length=4096,
    ),
    ServerInfo(
        model_name="m",
        max_model_len=8192,
        vocab_size=49152,
        block_size=16,
        num_blocks=1000,
        eos_token_ids=(2,),
        version="0.1.0",
        protocol_version="1",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        num_workers=2,
        host_id="h/boot",
        runner="pooling",
    ),
    SchedulerStats(
        num_running=3,
        num_waiting=4,
        num_blocks_total=100,
        num_blocks_used=10,
        kv_cache_usage=0.125,
        prefix_cache_queries=50,
        prefix_cache_hits=25,
        num_preemptions=1,
        num_steps=1000,
        step_time_p50=0.015,
        queue_time_p50=0.25,
        num_finished=7,
        healthy=True,
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=9,
        iteration_tokens_bucket_counts=[2, 0, 3],
        iteration_tokens_sum=40,
    ),
]
CASES.append(StructuredOutputParams(json='{"type": "object"}'))
MESSAGE_FOR = dict(convert.PAIRS)
UNSET_SAMPLING = SamplingParams(max_tokens=None)
REQUIRED_VALUES: dict[str, Any] = {
    "request_id": "r",
    "prompt_token_ids": [1],
    "lora_name": "a",
    "lora_int_id": 1,
}


def _message_class(obj: Any) -> type[Message]:
    return MESSAGE_FOR[type(obj)]


def _assert_every_field_set(msg: Message) -> None:
    """Every field (but the unused members of a oneof) is non-default, recursively."""
    set_names = {fd.name for fd, _ in msg.ListFields()}
    for fd in msg.DESCRIPTOR.fields:
        if fd.containing_oneof is not None and msg.WhichOneof(fd.containing_oneof.name) != fd.name:
            continue
        assert fd.name in set_names, f"{msg.DESCRIPTOR.name}.{fd.name} was not set"
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        for item in value if fd.is_repeated else [value]:
            _assert_every_field_set(item)


@pytest.mark.parametrize("obj", CASES, ids=lambda o: type(o).__name__)
def test_round_trip_with_all_fields_set(obj: Any) -> None:
    message_cls = _message_class(obj)
    msg = convert.to_proto(obj, message_cls)
    _assert_every_field_set(msg)
    wire = message_cls.FromString(msg.SerializeToString())
    assert convert.from_proto(wire, type(obj)) == obj


def _types_in(obj: Any) -> set[type]:
    """The type of `obj` and of every domain object inside it."""
    if isinstance(obj, (list, tuple)):
        return set().union(*map(_types_in, obj))
    if not dataclasses.is_dataclass(obj):
        return set()
    inside = [_types_in(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return {type(obj)}.union(*inside)


def test_every_pair_has_a_case() -> None:
    covered = set().union(*map(_types_in, CASES))
    assert {domain for domain, _ in convert.PAIRS} <= covered


@pytest.mark.parametrize("cls", [c for c, _ in convert.PAIRS], ids=lambda c: c.__name__)
def test_an_empty_message_decodes_to_the_defaults(cls: type) -> None:
    """One default per field: an unset field means what the dataclass defaults to (and a
    type whose defaults do not validate, like TensorHandle without a location, fails alike)."""
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]  # fmt: skip
    given = {name: REQUIRED_VALUES[name] for name in required}
    message = MESSAGE_FOR[cls](**given)
    try:
        expected = cls(**given)
        # the one field whose unset is None (up to max_model_len), not its default
        if cls is SamplingParams:
            expected = UNSET_SAMPLING
        elif hasattr(expected, "sampling_params"):
            expected = dataclasses.replace(expected, sampling_params=UNSET_SAMPLING)
    except ValueError:
        with pytest.raises(ValueError):
            convert.from_proto(message, cls)
        return
    assert convert.from_proto(message, cls) == expected


def test_unset_optional_fields_take_domain_defaults() -> None:
    from services.pb import engine_pb2

    params = convert.from_proto(engine_pb2.SamplingParams(), SamplingParams)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.repetition_penalty == 1.0
    # unset max_tokens is None, up to max_model_len (engine.proto), not SamplingParams()'s 16
    # for in-process callers, which travels set
    assert params.max_tokens is None and params.seed is None and params.logprobs is None
    assert convert.to_proto(SamplingParams(), engine_pb2.SamplingParams).max_tokens == 16
    # so min_tokens past 16 without max_tokens decodes (checked later against max_model_len)
    msg = engine_pb2.SamplingParams(min_tokens=100)
    assert convert.from_proto(msg, SamplingParams).min_tokens == 100
    # a zero value with a non-zero default travels (the field is `optional`)
    healthy = convert.to_proto(SchedulerStats(healthy=False), engine_pb2.SchedulerStats)
    assert convert.from_proto(healthy, SchedulerStats).healthy is False


def test_mismatched_dataclass_is_a_clear_error() -> None:
    from services.pb import engine_pb2

    with pytest.raises(TypeError, match="does not travel as"):
        convert.to_proto(LOGPROBS, engine_pb2.SamplingParams)


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputParams(json='{"type": "integer"}'),
        StructuredOutputParams(json_object=True),
        StructuredOutputParams(regex="[a-z]+"),
        StructuredOutputParams(choice=("a", "b c")),
        StructuredOutputParams(choice=()),  # rejected by structured_output.check, not here
        StructuredOutputParams(grammar='start: "x"'),
    ],
    ids=["json", "json_object", "regex", "choice", "empty_choice", "grammar"],
)
def test_each_structured_output_constraint_round_trips(constraint: StructuredOutputParams) -> None:
    """The oneof keeps exactly the constraint that was set, nested in SamplingParams."""
    from services.pb import engine_pb2

    params = SamplingParams(structured_output=constraint)
    msg = convert.to_proto(params, engine_pb2.SamplingParams)
    assert msg.HasField("structured_output")
    wire = engine_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert convert.from_proto(wire, SamplingParams) == params


def test_sampling_params_without_constraint_leave_the_message_unset() -> None:
    from services.pb import engine_pb2

    msg = convert.to_proto(SamplingParams(), engine_pb2.SamplingParams)
    assert not msg.HasField("structured_output")
    assert convert.from_proto(msg, SamplingParams).structured_output is None


def test_structured_output_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(regex="a", choice=("a",))
    assert StructuredOutputParams(choice=["a"]).choice == ("a",)  # type: ignore[arg-type]
