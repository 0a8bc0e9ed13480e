"""GGUF files served as they are: the default model's Q4_1 file, the same model
re-quantized to Q8_0, Q4_0, Q5_0 and Q5_1, and tiny random Llamas in the K-quants (Q4_K
linears with v, the down projections and the embedding/LM head in Q6_K, as llama.cpp's
Q4_K_M; all Q5_K). Tessera's greedy (float32 activations, the GEMMs over the
blocks) against HF transformers' greedy over the same file dequantized to float32, 8
prompts x 32 tokens; the weights stay in their blocks; bad files are refused by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.quality import PROMPTS
from benchmarks.quant_cases import AGREEMENT, NEW_TOKENS, hf_dequantized_greedy, tessera_greedy
from services.default_model import gguf_path
from services.gguf_model import GGUFError, check, prepare
from tessera import LLM
from tests.quant.gguf_files import requantize, tiny_llama, truncated
from worker_service.gguf import StackedBlocks
from worker_service.models.layers import Linear
from worker_service.models.quant import Q4_1, TYPE_NAMES

# The block formats of each file's Linears (the shipped file's token_embd, the LM head: Q8_0).
LINEAR_TYPES = {"Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"}, "Q4_1": {"Q4_1", "Q8_0"}, "Q5_0": {"Q5_0"},
                "Q5_1": {"Q5_1"}, "Q4_K": {"Q4_K", "Q6_K"}, "Q5_K": {"Q5_K"}}  # fmt: skip
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    made = {q: requantize(out / f"smollm2-{q}.gguf", q) for q in ("Q8_0", "Q4_0", "Q5_0", "Q5_1")}
    q4_k = tiny_llama(out / "tiny-llama-Q4_K.gguf", K_TYPES)
    q5_k = tiny_llama(out / "tiny-llama-Q5_K.gguf", dict.fromkeys(K_TYPES, "Q5_K"), seed=1)
    return {"Q4_1": gguf_path(), **made, "Q4_K": q4_k, "Q5_K": q5_k}


@pytest.fixture(scope="module", params=list(AGREEMENT))
def served(request: pytest.FixtureRequest, files: dict[str, Path]) -> Iterator[tuple[str, LLM]]:
    llm = LLM(
        model=str(files[request.param]), dtype="float32", kv_cache_memory="256MiB", max_num_seqs=8
    )
    yield request.param, llm
    llm.shutdown()


def test_greedy_equals_hf_over_the_dequantized_file(
    served: tuple[str, LLM], files: dict[str, Path]
) -> None:
    qtype, llm = served
    prompts = [llm.tokenizer.encode(p, False) for p in PROMPTS]
    ours = tessera_greedy(llm, prompts)
    theirs = hf_dequantized_greedy(files[qtype], prompts)
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"{qtype}: {equal}/8 prompts x {NEW_TOKENS} tokens equal HF over the dequantized file")
    assert equal >= AGREEMENT[qtype]
    assert all(a[:4] == b[:4] for a, b in zip(ours, theirs, strict=True))


def test_weights_stay_in_their_blocks(served: tuple[str, LLM]) -> None:
    qtype, llm = served
    model = llm.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quant is not None and m.weight.numel() == 0 for m in linears)
    types = {TYPE_NAMES[m.quant.ggml_type] for m in linears if m.quant is not None}
    assert types == LINEAR_TYPES[qtype]
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj").quant
    if qtype == "Q4_K":  # q, k Q4_K and v Q6_K: each part in its own format
        assert isinstance(qkv, StackedBlocks)
        assert [TYPE_NAMES[p.ggml_type] for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    embedding = model.embed_tokens  # its blocks too: no float copy of the table
    assert embedding.quant is not None and embedding.weight.numel() == 0
    dense = sum(p.numel() for p in model.parameters())
    assert dense == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)


def test_quantization_gguf_serves_the_default_models_file() -> None:
    llm = LLM(quantization="gguf", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=2)
    try:
        qkv = llm.worker.runner.model.get_submodule("layers.0.self_attn.qkv_proj")
        assert isinstance(qkv, Linear) and qkv.quant is not None and qkv.quant.ggml_type == Q4_1
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: requantize(p, "Q8_0", architecture="mamba"),
            "architecture 'mamba' is not served by Tessera",
        ),
        (lambda p: requantize(p, "Q8_0", broken_type=True), "token_embd.weight is Q2_K"),
        (truncated, "not a readable GGUF file"),
    ],
    ids=["architecture", "tensor-type", "truncated"],
)
def test_bad_files_are_refused_by_name(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    path = make(tmp_path / "bad.gguf")
    for refuse in (check, lambda p: prepare(p, tmp_path / "cache"), lambda p: LLM(model=str(p))):
        with pytest.raises(GGUFError, match=message) as info:
            refuse(path)
        assert str(path) in str(info.value)
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (tmp_path / "cache" / "gguf").iterdir()
    )


def test_quantization_values_that_cannot_apply_are_refused(files: dict[str, Path]) -> None:
    from services.default_model import weights_source

    assert weights_source("default", "gguf") == str(gguf_path())
    assert weights_source(str(files["Q8_0"]), "gguf") == str(files["Q8_0"])
    with pytest.raises(ValueError, match=r"needs a \.gguf model"):
        weights_source("acme/tiny", "gguf")
    with pytest.raises(ValueError, match="already quantized"):
        weights_source(str(files["Q8_0"]), "int8")


def test_stacked_blocks_put_each_parts_outputs_side_by_side() -> None:
    """A fused Linear of parts in different formats (and its bias) equals the matmul of the
    parts' dequantized rows, stacked."""
    from tests.worker.test_small_gemm import random_blocks
    from worker_service.models import cpu_ops
    from worker_service.models.quant import Q4_K, Q6_K, BlockWeight

    torch.manual_seed(0)
    parts = [BlockWeight(random_blocks(t, n, 512), t, 512, cpu_ops.load())
             for t, n in ((Q4_K, 8), (Q4_K, 5), (Q6_K, 3))]  # fmt: skip
    stacked = StackedBlocks.of(parts)
    x, bias = torch.randn(3, 512), torch.randn(16)
    w = stacked.dequantize(torch.float64)
    assert w.shape == (16, 512) and stacked.nbytes == sum(p.nbytes for p in parts)
    expected = x.double() @ w.T + bias.double()
    torch.testing.assert_close(stacked.linear(x, bias).double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stacked.linear(x, None).double(), expected - bias.double(),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("native", [True, False], ids=["cpu_ops", "torch"])
@pytest.mark.parametrize(
    "ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_embedding_in_blocks_looks_up_the_rows_of_the_dequantized_table(
    native: bool, ggml_type: str, dtype: torch.dtype
) -> None:
    """layers.Embedding over blocks returns, for ids of any shape, the rows the dense table
    dequantize(dtype) would, bit for bit (C++ rows or torch's), and keeps no float table; ids
    outside the table are refused."""
    from tests.worker.test_small_gemm import random_blocks
    from worker_service.models import cpu_ops
    from worker_service.models.layers import Embedding
    from worker_service.models.quant import BlockWeight

    ops = cpu_ops.load() if native else None
    assert not native or ops is not None, "the C++ ops build on every CI machine"
    torch.manual_seed(0)
    kind = next(t for t, name in TYPE_NAMES.items() if name == ggml_type)
    blocks = BlockWeight(random_blocks(kind, 37, 512), kind, 512, ops)
    embedding = Embedding(37, 512).to(dtype)
    embedding.set_blocks(blocks)
    assert embedding.weight.numel() == 0 and embedding.weight.dtype == dtype
    ids = torch.tensor([[36, 0, 5], [5, 17, 1]])
    out = embedding(ids)
    assert out.shape == (2, 3, 512) and out.dtype == dtype
    assert torch.equal(out, blocks.dequantize(dtype)[ids])
    assert embedding(torch.tensor([], dtype=torch.int64)).shape == (0, 512)
    with pytest.raises(IndexError):
        embedding(torch.tensor([37]))
