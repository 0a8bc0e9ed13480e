"""Pearson's chi-square goodness-of-fit test (scipy is not a dependency)."""

from __future__ import annotations

import numpy as np
import torch


def chisquare_pvalue(
    observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0
) -> float:
    """P-value of `observed` counts against `expected` counts (same total); categories with
    fewer than `min_expected` expected counts are pooled into one, as the test requires."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    small = expected < min_expected
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    if dof < 1:
        return 1.0
    # survival function of chi2(dof): the regularized upper incomplete gamma Q(dof/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))
