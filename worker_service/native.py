"""C++ sources of the CPU kernels, built at first use with the system compiler.

Each source is compiled once per source (with the local headers it includes), flags
and CPU level into Tessera's cache directory (`kernels/<stem>-<digest>.so`, written to
a temp file and renamed into place, older builds of the same stem pruned) and loaded through ctypes. `build()`
raises OSError or CalledProcessError where it cannot; callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from services.default_model import cache_root
from worker_service.cpu_kernels import read_cpu_info

log = logging.getLogger(__name__)

# torch's CPU capability -> the matching x86-64 level; elsewhere the compiler's default.
MARCH = {
    "AVX2": ["-march=x86-64-v3"],
    "AVX512": ["-march=x86-64-v4"],
    # AVX-512 with bf16 dot products; every such CPU (Cooper Lake, Sapphire Rapids, Zen 4) also
    # has VNNI's int8 dot products
    "AVX512_BF16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
}
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lmvec"]  # glibc's vector math (expf in loops)


@functools.cache
def cpu_level() -> str:
    """This CPU's MARCH key: torch's CPU capability (ATEN_CPU_CAPABILITY lowers it), raised
    to AVX512_BF16 where an AVX-512 CPU has bf16 dot products."""
    level = torch.backends.cpu.get_cpu_capability()
    if level == "AVX512" and "avx512_bf16" in read_cpu_info().flags:
        return "AVX512_BF16"
    return level


def amx_bf16_cpu() -> bool:
    """Whether this CPU has AMX tiles with bf16 products (the kernels still ask Linux for
    the tiles before their first use)."""
    return {"amx_tile", "amx_bf16"} <= read_cpu_info().flags


def compile_flags(level: str | None = None) -> list[str]:
    """Flags for `level` (a MARCH key; "" for the compiler's default), by default this CPU's."""
    level = cpu_level() if level is None else level
    return [*FLAGS, *MARCH.get(level, []), *LIBS]


def build(source: Path, level: str | None = None, extra: Sequence[str] = ()) -> ctypes.CDLL:
    """The library built from `source` for `level` (compile_flags) and `extra` flags (after
    the others: a later -std wins), built now unless cached. Tests build the levels below
    this CPU's to check each variant of a kernel."""
    flags = [*compile_flags(level), *extra]
    digest = hashlib.sha256(_text(source) + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{build_stem(source, level)}-{digest}.so"
    if not target.exists():
        _compile(source, target, flags)
    return ctypes.CDLL(str(target))


def build_stem(source: Path, level: str | None = None) -> str:
    """The file name of `source`'s builds for `level` before the digest: one build is kept
    per source and level (a new source replaces the older build of its level)."""
    if level is None:
        return source.stem
    return f"{source.stem}.{level.lower() or 'portable'}"


def _text(source: Path) -> bytes:
    """The source and the local headers it includes (`#include "name.h"`), as built."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join(_text(source.parent / h.decode()) for h in headers)


def _compile(source: Path, target: Path, flags: list[str]) -> None:
    stem = target.name.rsplit("-", 1)[0]
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, str(source), "-o", tmp, *flags], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)  # atomic: concurrent builders each publish a whole file
    finally:
        Path(tmp).unlink(missing_ok=True)
    for stale in target.parent.glob(f"{stem}-*.so"):  # older sources or flags, same level
        if stale != target:
            stale.unlink(missing_ok=True)
    log.info("built %s: %s", source.name, target)
