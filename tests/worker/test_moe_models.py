"""Issue 22, mixture of experts (Mixtral, Qwen2-MoE with a shared expert, a dense layer and no
renormalisation, Qwen3-MoE, OLMoE; greedy parity with HF through `LLM` and `tessera serve`:
tests/offline/test_families.py, tests/stack/test_families_serve.py): the grouped expert path
equals a per-token loop in float32 and bf16; the fused 3D checkpoint layout loads the same;
unsupported configs are refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.moe_bench import per_token_moe
from services.types import SamplingParams
from tessera.prompts import TokensPrompt
from tests.hf_reference import hf_greedy
from tests.worker.tiny_moe import PROMPTS, save_tiny_moe
from worker_service.models.moe import fused_moe_torch, select_experts


def test_fused_3d_expert_layout_loads_the_same(tmp_path: Path, default_model_dir: Path) -> None:
    """Experts stored as `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]."""
    path = save_tiny_moe("mixtral", tmp_path / "m", default_model_dir)
    expected = hf_greedy(path, PROMPTS[:2], 8)  # (from the per-expert layout HF saved)
    tensors = load_file(path / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        w1, w2, w3 = (
            torch.stack([tensors.pop(f"{prefix}.{e}.{w}.weight") for e in range(8)])
            for w in ("w1", "w2", "w3")
        )
        fused[f"{prefix}.gate_up_proj"] = torch.cat([w1, w3], dim=1)  # [E, 2I, H]
        fused[f"{prefix}.down_proj"] = w2  # [E, H, I]
    save_file({**tensors, **fused}, path / "model.safetensors", metadata={"format": "pt"})
    from tessera import LLM

    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:2]], params)]  # fmt: skip
    finally:
        llm.shutdown()
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_grouped_experts_equal_per_token_loop(dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    e, h, inter, k = 8, 64, 48, 2
    x = torch.randn(n, h).to(dtype)
    w13, w2 = (torch.randn(e, 2 * inter, h) / 8).to(dtype), (torch.randn(e, h, inter) / 7).to(dtype)
    weights, ids = select_experts(torch.randn(n, e).to(dtype), k, True, dtype == torch.float32)
    got = fused_moe_torch(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, per_token_moe(x, w13, w2, weights, ids), atol=tol, rtol=tol)


@pytest.mark.parametrize("n", [1, 9])
def test_expert_halves_sum_to_the_whole(n: int) -> None:
    """Expert parallel: each rank runs only its experts' pairs; the sum is the whole."""
    torch.manual_seed(n)
    x, w13, w2 = torch.randn(n, 32), torch.randn(6, 48, 32) / 6, torch.randn(6, 32, 24) / 5
    weights, ids = select_experts(torch.randn(n, 6), 3, True, True)
    halves = [
        fused_moe_torch(x, w13[s], w2[s], weights, ids, s.start) for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(halves[0] + halves[1], fused_moe_torch(x, w13, w2, weights, ids))


def test_select_experts_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    w, ids = select_experts(logits, 2, False, False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w[0], probs[[2, 1]])
    w, _ = select_experts(logits, 2, True, False)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))


def test_sliding_window_mixtral_is_refused(tmp_path: Path, default_model_dir: Path) -> None:
    path = save_tiny_moe("mixtral", tmp_path / "sw", default_model_dir, sliding_window=16)
    from worker_service.attention.reference import ReferenceAttentionBackend
    from worker_service.loader import load_model

    with pytest.raises(ValueError, match="sets sliding_window"):
        load_model(path, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["sliding_window"] == 16


def test_bf16_on_cpu_runs_experts_as_the_kernel_choice_says(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """bf16 on CPU: the experts follow the dense GEMM choice (float32 copies where bf16 is
    emulated, as Linear.pack does), and greedy decoding starts as HF's bf16 does."""
    from tessera import LLM
    from worker_service.cpu_kernels import choose_kernels, read_cpu_info
    from worker_service.models.moe import FusedMoE

    path = save_tiny_moe("qwen2_moe", tmp_path / "bf16", default_model_dir)
    prompts = PROMPTS[:4]
    expected = hf_greedy(path, prompts, 3, "bfloat16")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="64MiB")
    try:
        choice = choose_kernels(llm.worker.runner.config.model, read_cpu_info())
        moes = [m for m in llm.worker.runner.model.modules() if isinstance(m, FusedMoE)]
        packed = not choice.hf_exact and choice.float32_gemms
        assert all((m.compute is not None) == packed for m in moes) and moes
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
