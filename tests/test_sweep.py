"""remat.sweep: the log-log slope the sweeps fit."""

import pytest

from remat.sweep import loglog_slope


def test_loglog_slope():
  assert loglog_slope([2, 4, 8], [3, 6, 12]) == pytest.approx(1.0)
  assert loglog_slope([4, 16, 64], [2, 4, 8]) == pytest.approx(0.5)
