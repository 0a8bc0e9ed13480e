"""Issue 25: what rank 0 sends the other ranks is typed data (worker_service.tp_messages):
a step round-trips exactly, anything malformed is a ProtocolError (never evaluated), the
WorkerConfig a started rank reads is JSON, and local ranks meet in a private directory
with their sockets held to loopback."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from services.config import CacheConfig, ModelConfig, ParallelConfig, WorkerConfig
from worker_service import parallel, rendezvous
from worker_service.attention.base import AttentionMetadata
from worker_service.tp_messages import (
    MAGIC,
    Command,
    ProtocolError,
    decode_config,
    decode_step,
    encode_config,
    encode_step,
    header,
    read_header,
)


def _step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        block_table=torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 40], dtype=torch.int64),
        max_query_len=3,
        max_seq_len=9,
        query_lens_cpu=[3, 1],
        seq_lens_cpu=[3, 9],
    )
    return torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 8]), meta


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_a_step_round_trips_with_dtypes_and_shapes() -> None:
    ids, positions, meta = _step()
    text_len, payload = encode_step(ids, positions, meta)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    ids2, positions2, meta2 = decode_step(payload, text_len)
    assert _same(ids, ids2) and _same(positions, positions2)
    for name in vars(meta):
        assert _same(getattr(meta, name), getattr(meta2, name)), name


def _payload(edit: dict[str, object]) -> tuple[torch.Tensor, int]:
    """A step payload whose JSON description has `edit` applied."""
    text_len, payload = encode_step(*_step())
    described = json.loads(bytes(payload[:text_len].numpy()))
    described.update(edit)
    text = json.dumps(described).encode()
    head = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return torch.cat([head, payload[text_len:]]), len(text)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        ({"extra": 1}, "step fields"),
        ({"max_query_len": "__import__('os')"}, "must be an int"),
        ({"seq_lens_cpu": [1, "2"]}, "list of ints"),
        ({"input_ids": {"dtype": "object", "shape": [4], "offset": 0}}, "unsupported dtype"),
        ({"input_ids": {"dtype": "int64", "shape": [-4], "offset": 0}}, "bad shape"),
        ({"input_ids": {"dtype": "int64", "shape": [1 << 20], "offset": 0}}, "overrun"),
        ({"input_ids": {"dtype": "int64", "shape": [4]}}, "needs dtype, shape and offset"),
    ],
)
def test_a_malformed_step_is_refused(edit: dict[str, object], error: str) -> None:
    payload, text_len = _payload(edit)
    with pytest.raises(ProtocolError, match=error):
        decode_step(payload, text_len)


def test_a_description_that_is_not_json_is_refused() -> None:
    payload = torch.frombuffer(bytearray(b"\x80\x04\x95 not json"), dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_step(payload, payload.numel())


def test_headers_are_checked() -> None:
    assert read_header(header(Command.CACHE, 12)) == (Command.CACHE, 12, 0)
    assert read_header(header(Command.STOP)) == (Command.STOP, 0, 0)
    bad = [
        (torch.tensor([1, 1, 0, 0]), "bad magic"),
        (torch.tensor([MAGIC, 99, 0, 0]), "unknown tensor parallel command 99"),
        (header(Command.CACHE, 0), "cache command with 0 blocks"),
        (header(Command.STEP, 10, 1 << 40), "step payload"),
        (header(Command.STEP, 10, 5), "step payload"),
    ]
    for h, error in bad:
        with pytest.raises(ProtocolError, match=error):
            read_header(h)


def test_rank0_refuses_an_unknown_command_before_sending() -> None:
    group = parallel.TPGroup(rank=0, size=2)
    with pytest.raises(KeyError):
        group.command("eval")
    with pytest.raises(ValueError, match="send_step"):
        group.command("step")
    with pytest.raises(ProtocolError, match="cache command with 0 blocks"):
        group.command("cache")


def test_worker_config_travels_as_json() -> None:
    config = WorkerConfig(
        model=ModelConfig(model="/m", dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=8, kv_cache_memory_bytes=1 << 28),
        attention_backend="reference",
        max_num_seqs=8,
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    data = encode_config(config)
    assert json.loads(data)["cache"]["block_size"] == 8
    assert decode_config(data) == config
    tampered = json.loads(data)
    tampered["parallel"]["__class__"] = "os.system"
    with pytest.raises(ValueError, match="ParallelConfig has no field"):
        decode_config(json.dumps(tampered).encode())
    tampered = json.loads(data)
    tampered["cache"]["block_size"] = 3
    with pytest.raises(ValueError, match="block_size"):  # validated again
        decode_config(json.dumps(tampered).encode())


def test_local_ranks_meet_in_a_private_directory() -> None:
    how = parallel._rank0_rendezvous(ParallelConfig(tensor_parallel_size=2))
    assert isinstance(how, parallel.LocalRendezvous)
    directory = Path(how.path).parent
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert not Path(how.path).exists()  # the FileStore makes it, inside
    finally:
        directory.rmdir()


def test_local_ranks_refuse_an_init_method() -> None:
    with pytest.raises(ValueError, match="for ranks started by hand"):
        parallel._rank0_rendezvous(
            ParallelConfig(tensor_parallel_size=2, init_method="tcp://127.0.0.1:1234")
        )


def test_gloo_and_nccl_are_held_to_loopback() -> None:
    env: dict[str, str] = {"GLOO_SOCKET_IFNAME": "eth0"}
    rendezvous.hold_to_loopback(env)
    assert env == dict.fromkeys(rendezvous.LOOPBACK_SOCKET_VARS, rendezvous.loopback_interface())
    import psutil

    addresses = psutil.net_if_addrs()[env["GLOO_SOCKET_IFNAME"]]
    assert {a.address for a in addresses} & {"127.0.0.1"}


@pytest.mark.parametrize(
    ("method", "address"),
    [("tcp://10.0.0.5:29500", "10.0.0.5:29500"), ("tcp://[::1]:29500", "[::1]:29500")],
)
def test_init_methods_of_ranks_started_by_hand(method: str, address: str) -> None:
    assert rendezvous.store_address(method) == address


@pytest.mark.parametrize("method", ["env://", "file:///tmp/x", "tcp://host", "tcp://h:p"])
def test_other_init_methods_are_refused(method: str) -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        rendezvous.store_address(method)


def test_master_addr_and_port_make_the_init_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert parallel.resolve_init_method("") == "tcp://127.0.0.1:29500"
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_ADDR/PORT"):
        parallel.resolve_init_method("")
