"""remat.targets: a GPU target without its plugin is a one-line error."""

import pytest

from remat import targets
from remat.targets import TargetError


def test_gpu_target_error_without_plugin(monkeypatch):
  monkeypatch.setattr(targets, 'gpu_plugin_available', lambda: False)
  with pytest.raises(TargetError, match='needs the jax-cuda12 plugin'):
    targets.get_target('h200')
