"""HF transformers reference outputs, shared by the worker and stack tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from benchmarks.hf_greedy import hf_greedy_with

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@cache
def hf_model(model_dir: Path, dtype: str = "float32", attn_implementation: str = "sdpa") -> Any:
    """The HF model for `model_dir` in `dtype`, loaded once per process."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_DTYPES[dtype], attn_implementation=attn_implementation
    ).eval()


def hf_greedy(
    model_dir: Path,
    prompt_ids_list: list[list[int]],
    max_new_tokens: int,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
) -> list[list[int]]:
    """Greedy continuations by HF `generate`, one prompt at a time (no padding), never stopping
    at EOS: exactly `max_new_tokens` tokens per prompt."""
    return hf_greedy_with(
        hf_model(model_dir, dtype, attn_implementation), prompt_ids_list, max_new_tokens
    )


def hf_logits(model_dir: Path, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one forward over `ids`."""
    with torch.inference_mode():
        return hf_model(model_dir, dtype)(torch.tensor([ids])).logits[0].float()


@cache
def hf_base_model(model_dir: Path) -> Any:
    """HF `AutoModel` (the decoder without its head) for `model_dir` in float32."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_embeddings(
    model_dir: Path,
    prompt_ids_list: list[list[int]],
    pooling: str = "LAST",
    normalize: bool = True,
    dimensions: int | None = None,
) -> list[torch.Tensor]:
    """Each prompt's `last_hidden_state` [n, hidden] pooled as sentence-transformers does
    (LAST, MEAN, CLS, MAX over the unpadded prompt), truncated, L2-normalized."""
    model = hf_base_model(model_dir)
    results = []
    with torch.inference_mode():
        for ids in prompt_ids_list:
            hidden = model(torch.tensor([ids])).last_hidden_state[0].float()  # [n, hidden]
            pooled = {
                "LAST": lambda h: h[-1],
                "MEAN": lambda h: h.mean(0),
                "CLS": lambda h: h[0],
                "MAX": lambda h: h.amax(0),
            }[pooling](hidden)
            if dimensions is not None:
                pooled = pooled[:dimensions]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=0)
            results.append(pooled)
    return results


# float32, but not HF's summation order: oneDNN's packed GEMMs and Tessera's kernels block
# their reductions by CPU (AVX2 / AVX-512 / AMX) and row count, MKL under HF by its own
# choice, and over 30 layers the last digits drift. Seen up to 1.5e-5 on a unit vector on
# one CPU (1.4e-6 on another); elements are ~4e-2, and a wrong kernel misses by far more.
EMBEDDING_TOLERANCE = 1e-4


def assert_embeddings_close(got: list[Any], want: list[torch.Tensor]) -> None:
    """Each vector of `got` (lists or tensors) within EMBEDDING_TOLERANCE of `want`'s, in
    max |diff|, relative to the vector's largest element where that is above 1."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = torch.as_tensor(g, dtype=torch.float32)
        assert g.shape == w.shape, f"input {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        err = (g - w).abs().max().item()
        scale = max(1.0, w.abs().max().item())  # unnormalized vectors: relative to their size
        assert err < EMBEDDING_TOLERANCE * scale, f"input {i}: max |diff| {err:.2e} ({scale=:.1f})"
