"""The public API: every name in ``remat.__all__`` is what it says, and none hides a module."""

import importlib
import inspect
import pkgutil

import remat


def test_no_public_name_shadows_a_module():
  # `import remat.X as m` gives the attribute `remat.X` when there is one, so a function named
  # like its module would hide the module from a user who wants the module (issue 31).
  modules = {m.name for m in pkgutil.iter_modules(remat.__path__)}
  clashes = [n for n in remat.__all__ if n in modules and not inspect.ismodule(getattr(remat, n))]
  assert clashes == []
  for name in modules:
    module = importlib.import_module(f'remat.{name}')
    assert inspect.ismodule(module) and module.__name__ == f'remat.{name}'


def test_every_public_name_exists():
  assert all(hasattr(remat, n) for n in remat.__all__)
