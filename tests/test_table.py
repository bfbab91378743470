"""remat.table: the Pareto front the reports mark."""

from remat.table import pareto_front


def test_pareto_front():
  pts = {'a': (10, 1.0), 'b': (5, 1.2), 'c': (6, 1.3), 'd': (10, 1.1), 'e': (5, 1.2)}
  assert pareto_front(pts) == {'a', 'b', 'e'}
