"""Build a SamplingBatch from request states, and turn sampler tensors into domain logprobs."""

from __future__ import annotations

import numpy as np
import torch

from services.types import TokenLogprobs
from worker_service.input_batch import InputBatch, RequestState
from worker_service.sampler import Penalties, SamplerOutput, SamplingBatch


def build_sampling_batch(
    states: list[RequestState], batch: InputBatch, eos_ids: tuple[int, ...], device: torch.device
) -> SamplingBatch:
    """Per-row tensors for the rows that sample, skipping stages no row needs."""
    params = [s.params for s in states]
    greedy = [p.greedy for p in params]
    sb = SamplingBatch(
        temperature=torch.tensor([p.temperature for p in params], device=device),
        greedy=torch.tensor(greedy, device=device),
        all_greedy=all(greedy),
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
    )
    if not sb.all_greedy:
        _fill_filters(sb, states, device)
    if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
        sb.penalties = _penalties(states, batch, device)
    sb.bias = _bias(states, device)
    sb.banned = _banned(states, eos_ids, device)
    return sb


def _fill_filters(sb: SamplingBatch, states: list[RequestState], device: torch.device) -> None:
    params = [s.params for s in states]
    if any(p.top_k > 0 and not p.greedy for p in params):
        sb.top_k = torch.tensor(
            [p.top_k if p.top_k > 0 else 1 << 30 for p in params], device=device
        )
    if any(p.top_p < 1 for p in params):
        sb.top_p = torch.tensor([p.top_p for p in params], device=device)
    if any(p.min_p > 0 for p in params):
        sb.min_p = torch.tensor([p.min_p for p in params], device=device)
    sb.seeded = tuple(
        (i, s.params.seed, s.num_outputs)
        for i, s in enumerate(states)
        if s.params.seed is not None and not s.params.greedy
    )


def _penalties(states: list[RequestState], batch: InputBatch, device: torch.device) -> Penalties:
    """Prompt-token mask and output-token counts [B, V] from the token table, vectorized."""
    vocab = batch.vocab_size
    rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
    width = max(s.num_tokens for s in states)
    ids = torch.from_numpy(batch.token_ids[rows, :width]).to(device)  # [B, width]
    pos = torch.arange(width, device=device).unsqueeze(0)
    prompt_len = torch.tensor([s.prompt_len for s in states], device=device).unsqueeze(1)
    num_tokens = torch.tensor([s.num_tokens for s in states], device=device).unsqueeze(1)
    in_prompt = pos < prompt_len
    in_output = (pos >= prompt_len) & (pos < num_tokens)
    pad = torch.full_like(ids, vocab)  # an extra column absorbs the other positions
    counts = torch.zeros(len(states), vocab + 1, device=device)
    counts.scatter_add_(
        1, torch.where(in_output, ids, pad), torch.ones_like(ids, dtype=torch.float32)
    )
    prompt = torch.zeros(len(states), vocab + 1, dtype=torch.bool, device=device)
    prompt.scatter_(1, torch.where(in_prompt, ids, pad), True)
    return Penalties(
        repetition=torch.tensor([s.params.repetition_penalty for s in states], device=device),
        frequency=torch.tensor([s.params.frequency_penalty for s in states], device=device),
        presence=torch.tensor([s.params.presence_penalty for s in states], device=device),
        prompt_mask=prompt[:, :vocab],
        output_counts=counts[:, :vocab],
    )


def _bias(
    states: list[RequestState], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(i, t, b) for i, s in enumerate(states) for t, b in s.params.logit_bias.items()]
    if not entries:
        return None
    rows, cols, values = zip(*entries, strict=True)
    return (
        torch.tensor(rows, device=device),
        torch.tensor(cols, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _banned(
    states: list[RequestState], eos_ids: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) of EOS and stop ids for rows still short of min_tokens."""
    entries = []
    for i, s in enumerate(states):
        p = s.params
        if s.num_outputs < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            entries += [(i, t) for t in stops]
    if not entries:
        return None
    rows, cols = zip(*entries, strict=True)
    return torch.tensor(rows, device=device), torch.tensor(cols, device=device)


def to_token_logprobs(out: SamplerOutput, asks: list[int | None]) -> list[TokenLogprobs | None]:
    """One TokenLogprobs per row that asked (None for rows that did not)."""
    if out.logprobs is None or out.ranks is None:
        return [None] * len(asks)
    tokens, lps, ranks = out.token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[TokenLogprobs | None] = []
    for i, k in enumerate(asks):
        if k is None:
            result.append(None)
            continue
        entry = TokenLogprobs(token_id=tokens[i], logprob=lps[i], rank=ranks[i])
        if k > 0 and top_ids is not None and top_lps is not None:
            entry.top_token_ids, entry.top_logprobs = top_ids[i][:k], top_lps[i][:k]
        result.append(entry)
    return result
