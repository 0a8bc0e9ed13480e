"""Verification of draft tokens (speculative decoding), as vLLM V1's rejection sampler.

A request with K drafts d1..dK has K + 1 logit rows: row j is the target model's
distribution p_j after [..., last token, d1..dj]. Greedy rows accept while the target's
argmax equals the draft, then append the argmax of the first disagreeing row (the
correction) or of row K (the bonus token): the output equals plain greedy decoding.
Rows at temperature > 0 use rejection sampling with the draft as a point mass q = d_j:
accept d_j with probability p_j(d_j); on rejection sample from normalize(max(p_j - q, 0))
(p_j with d_j removed); after K acceptances sample the bonus from p_K. Each emitted
token is then distributed exactly as p. p_j is the sampler's own target distribution:
logit_bias, temperature, top-k, top-p and min-p applied as in worker_service.sampler.
"""

from __future__ import annotations

import torch

from worker_service.sampler import SamplingBatch, apply_constraints, argmax_rows, filter_probs


def rejection_sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: list[list[int]],
    generator: torch.Generator,
) -> list[list[int]]:
    """logits [sum(K_i + 1), V] (modified in place), batch over those rows (each request's
    parameters repeated K_i + 1 times) -> per request the accepted drafts + one token."""
    logits = apply_constraints(logits, batch)
    argmax = argmax_rows(logits).tolist()  # [R]
    probs = None
    if not batch.all_greedy:
        temperature = torch.where(batch.greedy, 1.0, batch.temperature).unsqueeze(1)
        probs = filter_probs(logits / temperature, batch)  # [R, V]
    greedy = batch.greedy.tolist()
    out, start = [], 0
    for draft in drafts:
        if greedy[start] or probs is None:
            out.append(_accept_greedy(argmax[start : start + len(draft) + 1], draft))
        else:
            out.append(_accept_random(probs[start : start + len(draft) + 1], draft, generator))
        start += len(draft) + 1
    return out


def _accept_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """argmax [K + 1] of the target rows -> accepted drafts + correction / bonus."""
    tokens = []
    for target, proposed in zip(argmax, draft, strict=False):
        tokens.append(target)
        if target != proposed:
            return tokens
    tokens.append(argmax[len(draft)])
    return tokens


def _accept_random(probs: torch.Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """probs [K + 1, V] of the target rows -> accepted drafts + recovered / bonus token."""
    k = len(draft)
    ids = torch.tensor(draft, device=probs.device)
    p_draft = probs[:k].gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # [K]
    # float64: torch's float32 uniforms on CPU are measurably biased for small tensors
    uniform = torch.rand(k + 1, generator=generator, dtype=torch.float64, device=probs.device)
    accept = uniform[:k].tolist()
    for j in range(k):
        if accept[j] < p_draft[j]:
            continue  # accepted
        residual = probs[j].clone()
        residual[draft[j]] = 0.0  # max(p - q, 0) with q the point mass on the draft
        if float(residual.sum()) > 0:  # else p_j(d_j) is 1 up to rounding: accepted
            return [*draft[:j], _sample(residual, uniform[k])]
    return [*draft, _sample(probs[k], uniform[k])]


def _sample(weights: torch.Tensor, uniform: torch.Tensor) -> int:
    """The index drawn with probability proportional to `weights` [V] by inverse CDF at
    `uniform` in [0, 1); zero weights are never drawn."""
    cdf = weights.double().cumsum(0)  # [V]
    index = torch.searchsorted(cdf, uniform * cdf[-1], right=True)
    return min(int(index), weights.shape[0] - 1)
