"""The dequant-GEMM part of benchmarks/gpu_check.py (run only on a CUDA machine).

1. Correctness: every case of tests/quant/test_quant_triton.py plus model-sized ones,
   the Triton dequant GEMM on CUDA tensors against dequantize-then-matmul in float32
   (through BlockWeight.linear for the formats quant.py knows, the kernel for the rest).
2. Timing (the median of CUDA-event timings, `median_ms` from gpu_check): M = 1 and 32 at
   the default model's (SmolLM2-135M) linear shapes, each format against torch's bf16
   F.linear over the dense weight.
3. Model: a Q4_1 GGUF (the default model's unless given) served on CUDA in float32 keeps
   every linear's blocks on CUDA; its greedy against HF's over the dequantized file, 8
   prompts x 32 tokens.

gpu_check runs them as three sections (model, timings, correctness: the slowest, a Triton
compile a shape, last). Each function takes the device, so the CPU-side code runs in the
interpreter test.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.quant_cases import CASES, TOLERANCE, random_blocks, reference_weight
from worker_service.models import quant_triton
from worker_service.models.quant import BLOCK_BYTES, BlockWeight

FORMAT_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (N, K) of the default model's linears: q (576 x 576), gate_up (3072 x 576), down (576 x 1536)
MODEL_SHAPES = [(576, 576), (3072, 576), (576, 1536), (1536, 576)]
LARGE_CASES = [(t, m, n, k) for t in FORMAT_NAMES for m in (1, 16, 100) for n, k in MODEL_SHAPES]
TIMING_ROWS = (1, 32)


def fits(ggml_type: int, k: int) -> bool:
    """Whether k inputs are whole blocks of the format (K-quants: 256)."""
    return k % quant_triton.LAYOUT[ggml_type][0] == 0


def block_matmul(
    blocks: torch.Tensor, ggml_type: int, k: int
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """(x, bias) -> x @ dequantize(blocks).T (+ bias), the way a served model computes it."""
    if ggml_type in BLOCK_BYTES:
        return BlockWeight(blocks, ggml_type, k, None).linear
    return lambda x, bias: quant_triton.dequant_gemm(x, blocks, ggml_type, bias)


def check_quant_case(
    ggml_type: int, m: int, n: int, k: int, dtype: torch.dtype, device: str = "cuda"
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(ggml_type * 1000 + m * 31 + n)
    blocks = random_blocks(n, k, ggml_type, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    ref = x.float() @ reference_weight(blocks, ggml_type).T + bias.float()
    got = block_matmul(blocks.to(device), ggml_type, k)(x.to(device), bias.to(device)).cpu()
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    label = f"{FORMAT_NAMES[ggml_type]}/M{m}/N{n}/K{k}/{dtype}"
    ok = got.dtype == dtype and err <= TOLERANCE[dtype]
    return {"case": label, "max_rel_err": err, "ok": ok}


def quant_correctness_cases() -> list[tuple[int, int, int, int, torch.dtype]]:
    """(format, M, N, K, dtype): the test cases in every dtype, the model-sized ones in bf16."""
    small = [(*c, dtype) for c in CASES if fits(c[0], c[3]) for dtype in DTYPES]
    return small + [(*c, torch.bfloat16) for c in LARGE_CASES if fits(c[0], c[3])]


def timing_case(
    ggml_type: int, m: int, n: int, k: int, device: str = "cuda"
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(the dequant GEMM, torch bf16 F.linear over the dense weight) on bf16 activations."""
    blocks = random_blocks(n, k, ggml_type, torch.Generator().manual_seed(n + k))
    dense = reference_weight(blocks, ggml_type).bfloat16().to(device)  # [N, K]
    matmul = block_matmul(blocks.to(device), ggml_type, k)
    x = torch.randn(m, k, device=device).bfloat16()
    return lambda: matmul(x, None), lambda: F.linear(x, dense)


def quant_timings(
    median_ms: Callable[[Callable[[], object]], float],
    shapes: list[tuple[int, int]] = MODEL_SHAPES,
    device: str = "cuda",
) -> list[dict[str, Any]]:
    rows = []
    for n, k in shapes:
        for m in TIMING_ROWS:
            for ggml_type, name in FORMAT_NAMES.items():
                if not fits(ggml_type, k):
                    continue
                quant, bf16 = timing_case(ggml_type, m, n, k, device)
                quant_ms, bf16_ms = median_ms(quant), median_ms(bf16)
                rows.append(
                    {
                        "shape": f"M{m} N{n} K{k}",
                        "format": name,
                        "dequant_gemm_ms": round(quant_ms, 4),
                        "torch_bf16_ms": round(bf16_ms, 4),
                        "bf16_over_dequant": round(bf16_ms / quant_ms, 3),
                    }
                )
    return rows


def model_check(path: Path | None = None) -> dict[str, Any]:
    """A Q4_1 GGUF on the CUDA worker: blocks on CUDA, greedy vs HF. `path`: the file (the
    default model's when None; benchmarks/gpu_carry.py cuts one that a device call carries)."""
    from benchmarks.quality import PROMPTS
    from benchmarks.quant_cases import AGREEMENT, hf_dequantized_greedy, tessera_greedy
    from services.default_model import gguf_path
    from tessera import LLM
    from worker_service.models.layers import Linear

    path = path or gguf_path()
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        linears = [m for m in llm.worker.runner.model.modules() if isinstance(m, Linear)]
        on_cuda = all(m.quant is not None and m.quant.blocks.is_cuda for m in linears)
        prompts = [llm.tokenizer.encode(p, False) for p in PROMPTS]
        ours = tessera_greedy(llm, prompts)
    finally:
        llm.shutdown()
    theirs = hf_dequantized_greedy(path, prompts)
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    ok = on_cuda and agree >= AGREEMENT["Q4_1"]
    return {
        "file": path.name,
        "blocks_on_cuda": on_cuda,
        "greedy_agreement": f"{agree}/{len(prompts)}",
        "ok": ok,
    }


def correctness_section() -> dict[str, Any]:
    """Every case (a line each on stderr as it finishes); "ok" false when one failed."""
    checks = []
    for case in quant_correctness_cases():
        started = time.perf_counter()
        checks.append(check_quant_case(*case))
        print(f"{checks[-1]} {time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)
    failed = [c for c in checks if not c["ok"]]
    return {
        "ok": not failed,
        "correctness_failed": failed,
        "correctness_passed": len(checks) - len(failed),
        "correctness_worst_err": max(checks, key=lambda c: c["max_rel_err"]),
    }


def timing_section(median_ms: Callable[[Callable[[], object]], float]) -> dict[str, Any]:
    return {"timings": quant_timings(median_ms)}
