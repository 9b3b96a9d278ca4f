"""fgrpo.evaluation.sweep_report: the pieces of the sweep report that are not tested through `python -m fgrpo.report`
(tests/test_report.py)."""

import numpy as np
import pytest

from fgrpo.evaluation.sweep_report import SUCCESS_BINS, success_rate_shares


def test_success_rate_shares_bin_edges():
    rates = np.array([0, 0, 0.05, 0.125, 0.2, 0.25, 0.5, 0.74, 0.75, 0.99, 1, 1])
    shares = success_rate_shares(rates)
    assert len(shares) == len(SUCCESS_BINS)
    np.testing.assert_allclose(shares * len(rates), [2, 1, 2, 1, 2, 2, 2])  # 0 and 1 only in their own bins
    with pytest.raises(ValueError, match="no success rates"):
        success_rate_shares(np.array([]))
