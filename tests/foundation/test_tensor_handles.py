"""Tensor handles: shm / inline round trips across real processes, proto round trips, errors.

The CUDA IPC test needs a GPU and is skipped without one (CI has none); it runs on a
machine with CUDA (for example via benchmarks or a device session).
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.pool import Pool
from pathlib import Path

import pytest
import torch

from services.convert import from_proto, to_proto
from services.pb import tensor_pb2
from services.tensor_handles import (
    ExportedTensor,
    TensorHandleError,
    dtype_from_name,
    dtype_name,
    export_tensor,
    open_tensor,
)
from services.types import CudaIpcLocation, SharedMemoryLocation, TensorHandle

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = ["float32", "bfloat16", "uint8"]
SHAPES = [(), (0,), (7,), (3, 5, 4), (2, 3, 16, 16)]


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same tensor in every process for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == "uint8":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return (torch.randn(shape, generator=gen) * 10).to(dtype_from_name(dtype))


def to_wire(handle: TensorHandle) -> bytes:
    return to_proto(handle, tensor_pb2.TensorHandle).SerializeToString()


def from_wire(data: bytes) -> TensorHandle:
    return from_proto(tensor_pb2.TensorHandle.FromString(data), TensorHandle)


def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes, str]:
    """(dtype, shape, raw bytes, device type): what a child reports about an opened tensor."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return dtype_name(tensor.dtype), tuple(tensor.shape), raw, tensor.device.type


# --- functions run in the spawned child ------------------------------------------------------

_HELD: list[ExportedTensor] = []


def child_open(handle_bytes: bytes) -> tuple[str, tuple[int, ...], bytes, str]:
    return describe(open_tensor(from_wire(handle_bytes)))


def child_export(dtype: str, shape: tuple[int, ...], seed: int, mode: str) -> bytes:
    exported = export_tensor(make_tensor(dtype, shape, seed), mode)  # type: ignore[arg-type]
    _HELD.append(exported)
    return to_wire(exported.handle)


def child_close_all() -> int:
    for exported in _HELD:
        exported.close()
    count = len(_HELD)
    _HELD.clear()
    return count


@pytest.fixture(scope="module")
def child() -> Iterator[Pool]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield pool


# --- across processes ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_child_opens_what_parent_exports(child: Pool, mode: str) -> None:
    cases = [(d, s, seed) for seed, (d, s) in enumerate((d, s) for d in DTYPES for s in SHAPES)]
    exports = [export_tensor(make_tensor(d, s, seed), mode) for d, s, seed in cases]  # type: ignore[arg-type]
    try:
        results = child.map(child_open, [to_wire(e.handle) for e in exports])
    finally:
        for e in exports:
            e.close()
    for (dtype, shape, seed), result in zip(cases, results, strict=True):
        assert result == describe(make_tensor(dtype, shape, seed)), (dtype, shape)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_parent_opens_what_child_exports(child: Pool, mode: str) -> None:
    cases = [(d, s, 100 + i) for i, (d, s) in enumerate((d, s) for d in DTYPES for s in SHAPES)]
    wires = [child.apply(child_export, (d, s, seed, mode)) for d, s, seed in cases]
    try:
        for (dtype, shape, seed), wire in zip(cases, wires, strict=True):
            opened = open_tensor(from_wire(wire))
            expected = make_tensor(dtype, shape, seed)
            assert opened.dtype == expected.dtype and torch.equal(opened, expected)
    finally:
        assert child.apply(child_close_all) == len(cases)
    if mode == "shm":  # the producer closed: the segments are gone
        with pytest.raises(TensorHandleError, match="is gone"):
            open_tensor(from_wire(wires[0]))


@pytest.mark.slow
def test_segment_survives_an_independent_consumer_exiting() -> None:
    """A consumer with its own resource tracker must not unlink the producer's segment."""
    tensor = make_tensor("float32", (4, 4), 7)
    with export_tensor(tensor, "shm") as exported:
        script = (
            "import sys; from tests.foundation.test_tensor_handles import from_wire; "
            "from services.tensor_handles import open_tensor; "
            "print(float(open_tensor(from_wire(sys.stdin.buffer.read())).sum()))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script],
            input=to_wire(exported.handle),
            capture_output=True,
            cwd=REPO_ROOT,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        assert float(proc.stdout) == pytest.approx(float(tensor.sum()))
        assert b"leaked" not in proc.stderr
        assert torch.equal(open_tensor(exported.handle), tensor)  # still there


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; CI has none")
def test_cuda_ipc_across_processes(child: Pool) -> None:
    tensor = make_tensor("bfloat16", (64, 33), 3).cuda()[:, 1:]  # a strided view
    with export_tensor(tensor) as exported:
        assert exported.handle.cuda_ipc is not None
        result = child.apply(child_open, (to_wire(exported.handle),))
    assert result == (*describe(tensor)[:3], "cuda")


# --- in process ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["shm", "inline"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_in_process(mode: str, dtype: str) -> None:
    for seed, shape in enumerate(SHAPES):
        tensor = make_tensor(dtype, shape, seed)
        with export_tensor(tensor, mode) as exported:  # type: ignore[arg-type]
            handle = from_wire(to_wire(exported.handle))
            opened = open_tensor(handle)
        assert handle.dtype == dtype and handle.shape == shape
        assert opened.dtype == tensor.dtype and torch.equal(opened, tensor)


def test_non_contiguous_tensor_is_stored_contiguously() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[1:]
    with export_tensor(tensor) as exported:
        opened = open_tensor(exported.handle)
    assert opened.is_contiguous() and torch.equal(opened, tensor)


def test_shm_copy_outlives_the_segment() -> None:
    tensor = make_tensor("float32", (5,), 1)
    with export_tensor(tensor, "shm") as exported:
        opened = open_tensor(exported.handle)
    assert exported.closed
    assert torch.equal(opened, tensor)
    with pytest.raises(TensorHandleError, match="is gone"):
        open_tensor(exported.handle)


def test_auto_mode_uses_shared_memory_on_cpu() -> None:
    with export_tensor(torch.zeros(3)) as exported:
        assert exported.handle.shared_memory is not None
        assert exported.handle.shared_memory.nbytes == 12


def test_handles_round_trip_through_proto_with_every_field() -> None:
    handles = [
        TensorHandle(
            dtype="bfloat16",
            shape=(2, 3, 4),
            cuda_ipc=CudaIpcLocation(
                device_index=1,
                ipc_memory_handle=b"\x01\x02ipc",
                storage_size_bytes=4096,
                storage_offset_bytes=512,
                tensor_offset=8,
                stride=(12, 4, 1),
                ref_counter_handle=b"/torch_ref",
                ref_counter_offset=3,
                event_handle=b"\x09event",
                event_sync_required=True,
            ),
        ),
        TensorHandle(dtype="uint8", shape=(6,), shared_memory=SharedMemoryLocation("seg", 16, 6)),
        TensorHandle(dtype="float32", shape=(1,), inline_bytes=b"\x00\x00\x80?"),
    ]
    for handle in handles:
        assert from_wire(to_wire(handle)) == handle


@pytest.mark.parametrize(
    "handle,message",
    [
        (TensorHandle(dtype="float33", shape=(1,), inline_bytes=b"1234"), "unknown tensor dtype"),
        (TensorHandle(dtype="Tensor", shape=(1,), inline_bytes=b"1234"), "unknown tensor dtype"),
        (TensorHandle(dtype="float32", shape=(2,), inline_bytes=b"1234"), "needs 8"),
        (TensorHandle(dtype="float32", shape=(-1,), inline_bytes=b""), "negative dimension"),
        (
            TensorHandle(dtype="uint8", shape=(4,), shared_memory=SharedMemoryLocation("x", 0, 3)),
            "3 bytes",
        ),
        (
            TensorHandle(
                dtype="uint8", shape=(4,), shared_memory=SharedMemoryLocation("tessera_none", 0, 4)
            ),
            "is gone",
        ),
    ],
)
def test_bad_handles_raise_clear_errors(handle: TensorHandle, message: str) -> None:
    with pytest.raises(TensorHandleError, match=message):
        open_tensor(handle)


def test_region_outside_segment_is_rejected() -> None:
    with export_tensor(torch.zeros(4, dtype=torch.uint8), "shm") as exported:
        assert exported.handle.shared_memory is not None
        name = exported.handle.shared_memory.name
        beyond = TensorHandle(
            dtype="uint8", shape=(4,), shared_memory=SharedMemoryLocation(name, 2, 4)
        )
        with pytest.raises(TensorHandleError, match="outside segment"):
            open_tensor(beyond)


def test_export_errors() -> None:
    with pytest.raises(TensorHandleError, match="CUDA tensor"):
        export_tensor(torch.zeros(2), "cuda_ipc")
    with pytest.raises(TensorHandleError, match="unknown export mode"):
        export_tensor(torch.zeros(2), "pigeon")  # type: ignore[arg-type]
    assert issubclass(TensorHandleError, ValueError)  # INVALID_ARGUMENT over gRPC
