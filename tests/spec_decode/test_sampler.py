"""The rejection sampler and the n-gram proposer, as units."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.spec_decode.chi2 import chisquare_pvalue
from worker_service.rejection_sampler import rejection_sample
from worker_service.sampler import SamplingBatch
from worker_service.spec_decode import ngram_propose


def _batch(num_rows: int, temperature: float) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((num_rows,), temperature),
        greedy=torch.full((num_rows,), temperature == 0),
        all_greedy=temperature == 0,
    )


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6])
    # suffix [5, 6] occurs at 0 and 6; the latest with 3 tokens after it is at 6
    assert ngram_propose(tokens, 1, 3, 3).tolist() == [7, 2, 3]
    # the longest suffix wins: [7, 5, 6] does not recur, [5, 6] does
    assert ngram_propose(np.array([1, 2, 3, 1, 2]), 2, 2, 5).tolist() == [3, 1, 2]
    assert ngram_propose(np.array([1, 2, 3, 4]), 1, 3, 2).tolist() == []  # nothing recurs
    assert ngram_propose(np.array([4, 4]), 2, 3, 2).tolist() == []  # too short for n = 2


def test_greedy_accepts_while_argmax_matches() -> None:
    # target argmax per row: 3, 5, 7, 2 (three drafts + one bonus row)
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 5, 7, 2]):
        logits[row, token] = 5.0
    gen = torch.Generator().manual_seed(0)
    all_ok = rejection_sample(logits.clone(), _batch(4, 0.0), [[3, 5, 7]], gen)
    assert all_ok == [[3, 5, 7, 2]]  # every draft accepted + the bonus
    second_wrong = rejection_sample(logits.clone(), _batch(4, 0.0), [[3, 4, 7]], gen)
    assert second_wrong == [[3, 5]]  # the correction replaces the first wrong draft
    first_wrong = rejection_sample(logits.clone(), _batch(4, 0.0), [[9, 5, 7]], gen)
    assert first_wrong == [[3]]


def test_two_requests_in_one_call() -> None:
    logits = torch.full((5, 10), -5.0)
    for row, token in enumerate([3, 5, 8, 8, 1]):  # request a: rows 0-2, request b: rows 3-4
        logits[row, token] = 5.0
    gen = torch.Generator().manual_seed(0)
    assert rejection_sample(logits, _batch(5, 0.0), [[3, 5], [2]], gen) == [[3, 5, 8], [8]]


@pytest.mark.parametrize("draft", [[0, 0], [2, 3], [4, 1]])
def test_temperature_one_keeps_the_target_distribution(draft: list[int]) -> None:
    """Whatever the drafts, the first emitted token follows p_0 and, after an accepted first
    draft, the second follows p_1 (chi-square, 20000 draws per case, fixed seed)."""
    p = torch.tensor(
        [[0.05, 0.1, 0.4, 0.15, 0.3], [0.5, 0.2, 0.1, 0.15, 0.05], [0.2] * 5]
    )  # rows: p_0, p_1, bonus
    gen = torch.Generator().manual_seed(1234)
    n, per_call = 20000, 1000  # 1000 identical requests per call, as in a batch
    first = np.zeros(5)
    second = np.zeros(5)
    for _ in range(n // per_call):
        logits = p.log().repeat(per_call, 1)
        for tokens in rejection_sample(logits, _batch(3 * per_call, 1.0), [draft] * per_call, gen):
            first[tokens[0]] += 1
            if len(tokens) > 1:  # the first draft was accepted: tokens[1] is drawn given it
                second[tokens[1]] += 1
    assert chisquare_pvalue(first, p[0].numpy() * n) > 1e-3
    if draft[0] == 0:  # p_0(0) = 0.05: accepted ~1000 times, enough for a test
        assert second.sum() > 500
    assert chisquare_pvalue(second, p[1].numpy() * second.sum()) > 1e-3


def test_top_k_applies_to_the_target() -> None:
    """A draft outside the top-k is never accepted at temperature 1."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    batch = _batch(2, 1.0)
    batch.top_k = torch.tensor([2, 2])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        (tokens,) = rejection_sample(logits.clone(), batch, [[0]], gen)
        assert tokens[0] in (2, 3)
