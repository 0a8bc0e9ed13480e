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
