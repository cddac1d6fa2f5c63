"""Unbiased pass@k and avg@k from per-example counts of correct samples.

With n samples of an example of which c are correct, the probability that at least one of k samples
drawn without replacement from them is correct (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over examples. It is 1 when n - c < k (every draw of k holds a correct one). The product
form 1 - prod_{i = n-c+1}^{n} (1 - k / i) avoids the huge binomials. avg@k is the mean fraction
of correct samples, mean(c / n): the expected accuracy of a single sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) for one example with n samples, c of them correct (0 <= c <= n, 1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(n: int, correct: Sequence[int], k: int) -> float:
    """pass@k averaged over examples, each with n samples and `correct[i]` correct ones."""
    return float(np.mean([pass_at_k(n, c, k) for c in correct])) if len(correct) else 0.0


def avg_at_k(n: int, correct: Sequence[int]) -> float:
    """mean(c / n) over examples: the expected accuracy of one sample."""
    return float(np.mean(np.asarray(correct, dtype=np.float64) / n)) if len(correct) else 0.0


def pass_k_values(k: int) -> list[int]:
    """The k's an eval reports: 1, k/2 (rounded down) and k, without repeats."""
    return sorted({1, max(1, k // 2), k})
