from math import comb

import pytest

from trace_rl.eval.passk import avg_at_k, mean_pass_at_k, pass_at_k, pass_k_values


@pytest.mark.parametrize("n,c,k", [(10, 3, 1), (10, 3, 5), (8, 1, 4), (5, 2, 2), (20, 7, 10), (4, 3, 2)])
def test_pass_at_k_equals_the_binomial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_on_constructed_counts():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # c = 0: never
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # c = n: always
    assert pass_at_k(6, 1, 6) == 1.0  # k = n: any correct sample is drawn
    assert pass_at_k(6, 0, 6) == 0.0
    assert pass_at_k(6, 3, 4) == 1.0  # n - c < k


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_means_over_examples():
    correct = [0, 2, 4]  # of n = 4 each
    assert avg_at_k(4, correct) == pytest.approx((0 + 0.5 + 1) / 3)
    assert mean_pass_at_k(4, correct, 1) == pytest.approx(avg_at_k(4, correct))  # pass@1 == avg@k
    assert mean_pass_at_k(4, correct, 2) == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    assert mean_pass_at_k(4, correct, 4) == pytest.approx(2 / 3)


def test_reported_ks():
    assert pass_k_values(8) == [1, 4, 8]
    assert pass_k_values(1) == [1]
    assert pass_k_values(3) == [1, 3]
