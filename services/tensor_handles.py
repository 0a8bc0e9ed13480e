"""Pass torch tensors between processes by reference: export as a TensorHandle, open on the
other side. The only module of `services` that imports torch (the scheduler never does).

Modes, chosen by `export_tensor(tensor, mode=...)`:
- "cuda_ipc" (auto for CUDA tensors): torch's CUDA IPC. `open_tensor` returns a zero-copy
  view of the producer's GPU memory. It must be opened in another process (CUDA cannot
  open its own IPC handle), and the producer must keep the ExportedTensor open until every
  consumer has dropped the tensors it opened (torch's rule for shared CUDA tensors).
  Consumers that keep the data longer should `.clone()` it.
- "shm" (auto for CPU tensors): a POSIX shared-memory segment holding the bytes
  contiguously. The producer owns the segment: it is unlinked when the ExportedTensor is
  closed (explicitly, by `with`, or when it is garbage collected / the process exits), so
  the producer keeps it open until every consumer has called `open_tensor`. `open_tensor`
  copies the bytes out into a new CPU tensor, so the consumer holds nothing afterwards;
  `map_tensor` instead returns a MappedTensor whose tensor lies inside the mapping (no
  copy), valid until the consumer closes it.
- "inline": the bytes inside the message; `open_tensor` returns a new CPU tensor. For peers
  that share no memory. Nothing to release.

A handle that cannot be opened (unknown dtype, sizes that disagree, a segment already
unlinked) raises TensorHandleError, a ValueError (INVALID_ARGUMENT over gRPC).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import sys
import weakref
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from unittest import mock

import torch

from services.types import CudaIpcLocation, SharedMemoryLocation, TensorHandle

ExportMode = Literal["auto", "cuda_ipc", "shm", "inline"]


class TensorHandleError(ValueError):
    """A TensorHandle that cannot be exported or opened."""


class ExportedTensor:
    """A handle plus what keeps its bytes alive on the producer side.

    Close it (or leave the `with` block) only after every consumer has opened the handle
    (shm) or released what it opened (CUDA IPC). Closing twice is harmless.
    """

    def __init__(
        self,
        handle: TensorHandle,
        segment: SharedMemory | None = None,
        keepalive: torch.Tensor | None = None,
    ) -> None:
        self.handle = handle
        self._keepalive = keepalive  # the CUDA tensor whose memory consumers map
        self._release = weakref.finalize(self, _release_segment, segment)

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        """Unlink the shared-memory segment and drop the CUDA tensor, if any."""
        self._release()
        self._keepalive = None

    def __enter__(self) -> ExportedTensor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def export_tensor(tensor: torch.Tensor, mode: ExportMode = "auto") -> ExportedTensor:
    """Export `tensor` (any layout; shm and inline store it contiguously). "auto" picks
    CUDA IPC on a GPU and shared memory on the CPU; "shm" and "inline" copy a GPU tensor
    to the host first."""
    if mode == "auto":
        mode = "cuda_ipc" if tensor.is_cuda else "shm"
    exporters: dict[str, Callable[[torch.Tensor], ExportedTensor]] = {
        "cuda_ipc": _export_cuda_ipc,
        "shm": _export_shm,
        "inline": _export_inline,
    }
    if mode not in exporters:
        raise TensorHandleError(f"unknown export mode {mode!r}")
    return exporters[mode](tensor.detach())


def open_tensor(handle: TensorHandle) -> torch.Tensor:
    """The tensor a handle refers to: a new CPU tensor for shm and inline, a zero-copy CUDA
    tensor for CUDA IPC (see the module docstring for lifetimes)."""
    dtype = dtype_from_name(handle.dtype)
    shape = _checked_shape(handle.shape)
    if handle.cuda_ipc is not None:
        return _open_cuda_ipc(handle.cuda_ipc, dtype, shape)
    nbytes = math.prod(shape) * _element_size(dtype)
    if handle.shared_memory is not None:
        return _open_shm(handle.shared_memory, dtype, shape, nbytes)
    assert handle.inline_bytes is not None  # TensorHandle guarantees one location
    if len(handle.inline_bytes) != nbytes:
        raise TensorHandleError(
            f"inline tensor has {len(handle.inline_bytes)} bytes, {handle.dtype}{list(shape)} "
            f"needs {nbytes}"
        )
    return _from_bytes(bytearray(handle.inline_bytes), dtype, shape)


class MappedTensor:
    """A handle opened without copying: for shm, `tensor` is a view of the mapped segment
    (`mapping` is the mapped [address, address + size)). Drop every reference to `tensor`
    (and its views) before `close()`, which unmaps the segment; closing twice is harmless."""

    def __init__(
        self,
        tensor: torch.Tensor,
        segment: SharedMemory | None = None,
        mapping: tuple[int, int] = (0, 0),
    ) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.mapping = mapping
        self._segment = segment

    @property
    def closed(self) -> bool:
        return self.tensor is None and self._segment is None

    def close(self) -> None:
        self.tensor = None
        if self._segment is not None:
            self._segment.close()  # BufferError while a view of the segment is still alive
            self._segment = None

    def __enter__(self) -> MappedTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_tensor(handle: TensorHandle) -> MappedTensor:
    """Open `handle` without copying where the location allows it: a shm segment is mapped
    and the tensor is a view inside it; CUDA IPC is zero-copy already; inline bytes are
    turned into a tensor (the only copy, as the bytes came in the message)."""
    if handle.shared_memory is None:
        return MappedTensor(open_tensor(handle))
    dtype = dtype_from_name(handle.dtype)
    shape = _checked_shape(handle.shape)
    loc = handle.shared_memory
    nbytes = math.prod(shape) * _element_size(dtype)
    if loc.nbytes != nbytes:
        raise TensorHandleError(f"shm region has {loc.nbytes} bytes, tensor needs {nbytes}")
    segment = _attach(loc.name)
    try:
        _check_region(segment, loc, nbytes)
        whole = torch.frombuffer(segment.buf, dtype=torch.uint8)  # [segment.size] uint8
        mapping = (whole.data_ptr(), whole.data_ptr() + segment.size)
        view = whole[loc.offset : loc.offset + nbytes]
        del whole
        tensor = view.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        del view
    except BaseException:
        segment.close()
        raise
    return MappedTensor(tensor, segment, mapping)


def host_id() -> str:
    """This host and shared-memory namespace: the kernel boot id and the host name (two
    containers on one machine differ by host name, and usually by /dev/shm too)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.is_file() else ""
    return f"{socket.gethostname()}/{boot_id}"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling TensorHandle.dtype uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16; TensorHandleError for anything else."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise TensorHandleError(f"unknown tensor dtype {name!r}")
    return dtype


# --- shared memory -----------------------------------------------------------------------


def _export_shm(tensor: torch.Tensor) -> ExportedTensor:
    data = _as_bytes_view(tensor)  # [nbytes] uint8
    name = f"tessera_{os.getpid()}_{secrets.token_hex(6)}"
    segment = SharedMemory(name=name, create=True, size=max(1, data.numel()))
    if data.numel():
        torch.frombuffer(segment.buf, dtype=torch.uint8, count=data.numel()).copy_(data)
    location = SharedMemoryLocation(name=name, offset=0, nbytes=data.numel())
    handle = TensorHandle(
        dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), shared_memory=location
    )
    return ExportedTensor(handle, segment=segment)


def _open_shm(
    loc: SharedMemoryLocation, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
) -> torch.Tensor:
    if loc.nbytes != nbytes:
        raise TensorHandleError(f"shm region has {loc.nbytes} bytes, tensor needs {nbytes}")
    segment = _attach(loc.name)
    try:
        _check_region(segment, loc, nbytes)
        return _copy_region(segment, loc.offset, nbytes).view(dtype).reshape(shape)
    finally:
        segment.close()


def _check_region(segment: SharedMemory, loc: SharedMemoryLocation, nbytes: int) -> None:
    if loc.offset < 0 or loc.offset + nbytes > segment.size:
        raise TensorHandleError(
            f"region [{loc.offset}, {loc.offset + nbytes}) lies outside segment "
            f"{loc.name!r} of {segment.size} bytes"
        )


def _attach(name: str) -> SharedMemory:
    """Attach to an existing segment without registering it with this process's resource
    tracker (which would unlink the producer's segment when this process exits). Before
    Python 3.13 that means muting `resource_tracker.register` for the call: a segment that
    another thread creates at that very moment goes untracked (leaks only on a crash)."""
    try:
        if sys.version_info >= (3, 13):
            return SharedMemory(name=name, track=False)
        with mock.patch.object(resource_tracker, "register", lambda *args, **kwargs: None):
            return SharedMemory(name=name)
    except FileNotFoundError:
        raise TensorHandleError(
            f"shared-memory segment {name!r} is gone: the producer closed it before this "
            "consumer opened the handle"
        ) from None


def _copy_region(segment: SharedMemory, offset: int, nbytes: int) -> torch.Tensor:
    """A new uint8 tensor with the region's bytes; no view of the segment survives."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=offset).clone()


def _release_segment(segment: SharedMemory | None) -> None:
    if segment is None:
        return
    segment.close()
    with contextlib.suppress(FileNotFoundError):  # unlinked by someone else already
        segment.unlink()


# --- inline ------------------------------------------------------------------------------


def _export_inline(tensor: torch.Tensor) -> ExportedTensor:
    data = bytes(_as_bytes_view(tensor).numpy())
    handle = TensorHandle(
        dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), inline_bytes=data
    )
    return ExportedTensor(handle)


def _as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:  # [nbytes] uint8 on the CPU
    return tensor.cpu().contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


# --- CUDA IPC ----------------------------------------------------------------------------


def _export_cuda_ipc(tensor: torch.Tensor) -> ExportedTensor:
    if not tensor.is_cuda:
        raise TensorHandleError("cuda_ipc export needs a CUDA tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, tensor_offset, _, dtype, device, ipc_handle, storage_bytes) = args[:9]
    (storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args[9:]
    location = CudaIpcLocation(
        device_index=int(device),
        ipc_memory_handle=bytes(ipc_handle),
        storage_size_bytes=int(storage_bytes),
        storage_offset_bytes=int(storage_offset),
        tensor_offset=int(tensor_offset),
        stride=tuple(stride),
        ref_counter_handle=bytes(ref_handle or b""),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )
    handle = TensorHandle(dtype=dtype_name(dtype), shape=tuple(size), cuda_ipc=location)
    return ExportedTensor(handle, keepalive=tensor)


def _open_cuda_ipc(
    loc: CudaIpcLocation, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(loc.stride) != len(shape):
        raise TensorHandleError(f"stride {list(loc.stride)} does not match shape {list(shape)}")
    args: tuple[Any, ...] = (
        torch.Tensor,
        torch.Size(shape),
        tuple(loc.stride),
        loc.tensor_offset,
        torch.storage.TypedStorage,
        dtype,
        loc.device_index,
        loc.ipc_memory_handle,
        loc.storage_size_bytes,
        loc.storage_offset_bytes,
        False,  # requires_grad
        loc.ref_counter_handle,
        loc.ref_counter_offset,
        loc.event_handle,
        loc.event_sync_required,
    )
    tensor: torch.Tensor = rebuild_cuda_tensor(*args)
    return tensor


# --- checks ------------------------------------------------------------------------------


def _checked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if any(d < 0 for d in shape):
        raise TensorHandleError(f"negative dimension in shape {list(shape)}")
    return tuple(int(d) for d in shape)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
