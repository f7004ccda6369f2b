"""The statistics over seeds the experiments report, against numbers worked by hand."""

import math

import pytest

from efla_lab.seeds import gap_in_standard_errors, paired_differences, sample_std, spread


def test_spread_is_the_mean_sample_std_and_standard_error():
    s = spread([1.0, 2.0, 4.0])  # mean 7/3; deviations -4/3, -1/3, 5/3: sum of squares 42/9 over n - 1 = 2
    assert s["mean"] == pytest.approx(7 / 3) and s["n"] == 3
    assert s["std"] == pytest.approx(math.sqrt(7 / 3))
    assert s["standard_error"] == pytest.approx(math.sqrt(7 / 3) / math.sqrt(3))
    assert sample_std([5.0]) == 0.0 and spread([5.0])["standard_error"] == 0.0


def test_paired_differences_pair_by_seed():
    assert paired_differences({1: 0.5, 2: 0.7}, {2: 0.4, 1: 0.6}) == pytest.approx({1: -0.1, 2: 0.3})
    with pytest.raises(KeyError):
        paired_differences({3: 1.0}, {1: 1.0})


def test_gap_in_standard_errors_uses_each_groups_own_variance():
    gap, t = gap_in_standard_errors([2.0, 4.0], [1.0, 1.0, 4.0])
    # means 3 and 2; variances 2 and 3; error sqrt(2/2 + 3/3) = sqrt(2)
    assert gap == pytest.approx(1.0) and t == pytest.approx(1 / math.sqrt(2))
