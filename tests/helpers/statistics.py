"""Statistical tests the distribution tests share."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; categories with under 10 counts in both samples
    together are pooled (the pooling looks at the sums only, so it favours neither sample)."""
    keys = sorted(set(a) | set(b), key=lambda k: (-(a[k] + b[k]), str(k)))
    rows, other = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 10:
            rows.append([a[k], b[k]])
        else:
            other[0] += a[k]
            other[1] += b[k]
    if sum(other):
        rows.append(other)
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(rows) - 1) / 2, dtype=torch.float64), stat / 2))
