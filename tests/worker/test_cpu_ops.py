"""The fused CPU ops (cpu_ops.cpp) against the torch code they replace: bf16 results equal
bit for bit (HF's rounding order) but for rare ties of the norm's float32 sum order; float32
within float rounding; a whole bf16 model with them gives the torch path's logits; the greedy
pick (argmax_rows) picks torch's max(dim) index on every build level."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.step_types import NewRequestData
from tests.worker.test_qwen_models import _save_tiny
from tests.worker.test_small_gemm import _runnable_levels
from worker_service import kv_cache
from worker_service.attention.cpu import CpuAttentionBackend
from worker_service.input_batch import InputBatch
from worker_service.loader import load_model
from worker_service.models import cpu_ops
from worker_service.models.context import forward_context
from worker_service.models.layers import RMSNorm, RotaryEmbedding
from worker_service.models.llama import LlamaForCausalLM

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops() -> cpu_ops.CpuOps:
    loaded = cpu_ops.load()
    assert loaded is not None, "the fused CPU ops did not build (g++ missing?)"
    return loaded


def _assert_matches(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if ref.dtype == torch.bfloat16:
        assert (ours == ref).float().mean().item() >= 0.9999
        torch.testing.assert_close(ours, ref, atol=0, rtol=2**-7)  # at most one bf16 ulp
    else:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 300])
def test_add_rms_norm(ops: cpu_ops.CpuOps, dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.randn(576) * 0.1 + 1).to(dtype)
    x, residual = torch.randn(n, 576).to(dtype), torch.randn(n, 576).to(dtype)
    ref_out, ref_res = norm(x, residual)
    out, res = ops.add_rms_norm(x, residual.clone(), norm.weight, 1e-5)
    assert torch.equal(res, ref_res)  # the residual sum is one rounding, as HF's
    _assert_matches(out, ref_out)
    alone, same = ops.add_rms_norm(x.clone(), None, norm.weight, 1e-5)
    _assert_matches(alone, norm(x)[0])
    assert torch.equal(same, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 300])
def test_rope_in_place_on_strided_rows(ops: cpu_ops.CpuOps, dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    qkv = torch.randn(n, 15 * 64 + 3 * 64).to(dtype)  # q + k heads, then v
    qk = qkv[:, : 15 * 64].view(n, 15, 64)
    positions = torch.randint(0, 2048, (n,))
    freqs = torch.outer(positions.float(), 1.0 / (10000 ** (torch.arange(0, 64, 2) / 64)))
    cos, sin = freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)
    ref = RotaryEmbedding.rotate(qk, (cos, sin))
    v_before = qkv[:, 15 * 64 :].clone()
    ops.rope_(qk, cos, sin)
    _assert_matches(qk, ref)
    assert torch.equal(qkv[:, 15 * 64 :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 32, 200])
def test_silu_mul(ops: cpu_ops.CpuOps, dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    gate_up = (torch.randn(n, 2 * 1536) * 3).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    _assert_matches(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen2", tmp_path_factory.mktemp("qwen2-ops"))


def test_model_with_fused_ops_matches_torch_layers(ops: cpu_ops.CpuOps, tiny_dir: Path) -> None:
    models = [
        load_model(tiny_dir, torch.bfloat16, torch.device("cpu"), CpuAttentionBackend())
        for _ in range(2)
    ]
    models[1].use_cpu_ops(ops)
    ids = torch.arange(1, 25)
    hidden = [_prefill(m, ids) for m in models]
    assert (hidden[0] == hidden[1]).float().mean().item() >= 0.999
    torch.testing.assert_close(hidden[1].float(), hidden[0].float(), atol=0.05, rtol=0.02)


def _prefill(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of one prompt run as a single prefill over a fresh KV pool."""

    spec = kv_cache.make_spec(model.config, 16, torch.bfloat16)
    kv_cache.allocate(model, spec, 4, torch.bfloat16, torch.device("cpu"))
    batch = InputBatch(1, 64, 16, model.config.vocab_size)
    state = batch.add(NewRequestData("r", ids.tolist(), block_ids=[0, 1]))
    step = batch.prepare([state], [len(ids)], torch.device("cpu"))
    with torch.inference_mode(), forward_context(step.meta):
        return model(step.input_ids, step.positions)


def _argmax_cases() -> list[torch.Tensor]:
    """Rows that test the first-maximum rule: random; ties within a lane, across lanes and in
    the tail; the maximum first, last or in the tail; -inf only; NaN after or before the max."""
    torch.manual_seed(0)
    cases = [torch.randn(b, v) for b, v in ((1, 49152), (3, 49152), (32, 49152), (5, 17), (2, 33))]
    ties = torch.randn(6, 100)
    for row, places in enumerate(([3, 19], [19, 3 + 32], [40, 97], [99], [0, 96], [16, 17])):
        ties[row, places] = 9.0
    minus_inf = torch.full((2, 40), float("-inf"))
    minus_inf[1, 35] = -1e30  # the only finite value, in the tail
    nan = torch.randn(3, 50)
    nan[0, [7, 30]] = float("nan")
    nan[1, 2] = float("inf")
    nan[1, 45] = float("nan")
    nan[2, 49] = float("nan")
    return [*cases, ties, minus_inf, nan, torch.zeros(1, 1)]


@pytest.mark.parametrize("level", _runnable_levels(), ids=lambda v: v or "portable")
def test_argmax_rows_picks_what_torch_max_picks(level: str) -> None:
    ops = cpu_ops.build(level)
    for x in _argmax_cases():
        assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices), x.shape
