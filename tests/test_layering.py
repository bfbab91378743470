"""The house's floors: no import circles, no import that runs back up, and remat stands alone.

The application is built in floors, each importing only itself and the floors below it:
``remat`` (the library) < ``models`` < ``configs`` < ``training`` < ``bench`` < ``baselines`` <
``train.py``. Every ``import`` in those files counts, at module level or inside a function,
read from the source with :mod:`ast` (nothing is imported to check it). The library imports
only the standard library and its own dependencies, imports without the application, and
installs as ``remat`` only.
"""

import ast
import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ('models', 'training', 'configs', 'baselines', 'bench', 'train')
# Lowest first: a module may import its own floor and the floors below it, never one above.
FLOORS = ('remat', 'models', 'configs', 'training', 'bench', 'baselines', 'train')
# What the library may import besides the standard library: JAX, Flax and NumPy, and the
# declared dependencies it uses for one feature each (optax: the optimizer of remat.fused_update;
# tqdm and matplotlib: progress bars and plots of the measurements; jaxlib: the compile cache's
# version; equinox: the optional remat.eqx front door, imported inside its functions).
LIBRARY_IMPORTS = {'jax', 'jaxlib', 'flax', 'numpy', 'optax', 'tqdm', 'matplotlib', 'equinox'}


def _modules() -> dict[str, Path]:
  """Dotted module name -> file, for every module of the library and the application."""
  found = {'train': ROOT / 'train.py'}
  for floor in FLOORS[:-1]:
    for path in sorted((ROOT / floor).rglob('*.py')):
      parts = path.relative_to(ROOT).with_suffix('').parts
      found['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  return found


def _imported(module: str, path: Path) -> list[tuple[str, int]]:
  """(dotted name, line) of every import in ``path``, at any depth.

  ``from a import b`` gives ``a.b`` (a module, or a name in ``a``); relative imports are
  resolved against the module's package.
  """
  package = module if path.name == '__init__.py' else module.rpartition('.')[0]
  names = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        up = package.split('.')[:len(package.split('.')) - (node.level - 1)]
        base = '.'.join(up + ([node.module] if node.module else []))
      names += [(f'{base}.{alias.name}', node.lineno) for alias in node.names]
  return names


def _graph():
  """(edges, external): module -> {imported module: line}; module -> {top-level name: line}.

  An import names the longest known module it starts with (``from remat import LayerStack``
  is an edge to the package ``remat``). The parent packages Python runs on the way
  (``remat/__init__`` before ``remat.stack``) are not edges: a package's own modules import
  each other through it without forming a circle.
  """
  modules = _modules()
  edges, external = {}, {}
  for module, path in modules.items():
    edges[module], external[module] = {}, {}
    for name, line in _imported(module, path):
      parts = name.split('.')
      target = next(('.'.join(parts[:i]) for i in range(len(parts), 0, -1)
                     if '.'.join(parts[:i]) in modules), None)
      if target is None:
        external[module].setdefault(parts[0], line)
      elif target != module:
        edges[module].setdefault(target, line)
  return edges, external


def _cycles(edges) -> list[list[str]]:
  """One circle (its path, first module repeated at the end) per strongly connected group."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(v):  # Tarjan's algorithm, recursive: the graph has a few hundred modules
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.add(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(group)

  for v in sorted(edges):
    if v not in index:
      visit(v)
  cycles = []
  for group in groups:  # the shortest way back to the group's first module
    start = min(group)
    paths = {w: [start, w] for w in edges[start] if w in group}
    frontier = list(paths)
    while start not in paths:
      nxt = []
      for v in frontier:
        for w in sorted(edges[v]):
          if w in group and w not in paths:
            paths[w] = paths[v] + [w]
            nxt.append(w)
      frontier = nxt
    cycles.append(paths[start])
  return sorted(cycles)


def _floor(module: str) -> int:
  return FLOORS.index(module.split('.')[0])


def _upward(edges) -> list[str]:
  """Each import of a module on a higher floor than the importer's."""
  return [f'{m} imports {t} (line {line})' for m in sorted(edges)
          for t, line in sorted(edges[m].items()) if _floor(t) > _floor(m)]


def _describe(cycle, edges) -> str:
  return ' -> '.join(f'{a} (line {edges[a][b]})' for a, b in zip(cycle, cycle[1:])) + \
      f' -> {cycle[-1]}'


def test_no_import_circles():
  edges, _ = _graph()
  cycles = _cycles(edges)
  assert not cycles, 'import circles (each import at the line given):\n' + '\n'.join(
      _describe(c, edges) for c in cycles)


def test_no_import_runs_back_up():
  edges, _ = _graph()
  assert _upward(edges) == [], f'floors, lowest first: {", ".join(FLOORS)}'


def test_the_library_imports_only_its_dependencies():
  edges, external = _graph()
  allowed = LIBRARY_IMPORTS | set(sys.stdlib_module_names)
  outside = [f'{m} imports {name} (line {line})' for m in sorted(external) if _floor(m) == 0
             for name, line in sorted(external[m].items()) if name not in allowed]
  assert outside + _upward({m: e for m, e in edges.items() if _floor(m) == 0}) == []


def test_the_checks_see_circles_and_upward_imports(tmp_path):
  """The helpers on made-up sources: they report what the three tests above forbid."""
  edges = {'models.a': {'models.b': 3}, 'models.b': {'models.c': 5}, 'models.c': {'models.a': 7},
           'models.d': {'training.x': 1}, 'training.x': {'models.d': 2}}
  assert _cycles(edges) == [['models.a', 'models.b', 'models.c', 'models.a'],
                            ['models.d', 'training.x', 'models.d']]
  assert _describe(_cycles(edges)[0], edges) == (
      'models.a (line 3) -> models.b (line 5) -> models.c (line 7) -> models.a')
  assert _upward(edges) == ['models.d imports training.x (line 1)']
  # imports inside functions, relative ones and `from a import b` are all read
  pkg = tmp_path / 'pkg'
  pkg.mkdir()
  (pkg / 'mod.py').write_text('import os\n\ndef f():\n  from . import other\n'
                              '  from models.gpt import GPT as g\n')
  assert _imported('pkg.mod', pkg / 'mod.py') == [('os', 1), ('pkg.other', 4),
                                                  ('models.gpt.GPT', 5)]

# Run in a fresh interpreter: every remat module imported while the application packages
# cannot be (a meta-path finder refuses them, whatever sys.path holds).
_IMPORT_ALL = f"""
import importlib, pkgutil, sys

class Refuse:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in {APP!r}:
      raise ImportError(f'application package {{name}} imported by the library')
    return None

sys.meta_path.insert(0, Refuse())
import remat
names = sorted(m.name for m in pkgutil.iter_modules(remat.__path__, 'remat.'))
for name in names:
  importlib.import_module(name)
print(' '.join(names))
"""


def test_every_remat_module_imports_without_the_application():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  run = subprocess.run([sys.executable, '-c', _IMPORT_ALL], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  modules = run.stdout.split()
  assert {'remat.measuring', 'remat.report', 'remat.sweep', 'remat.table'} <= set(modules)


def test_wheel_holds_only_remat(tmp_path):
  # Built from a copy of the tracked sources, so the checkout gets no build/ or egg-info.
  files = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard'], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
  src = tmp_path / 'src'
  for f in files:
    if (ROOT / f).is_file():
      (src / f).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / f, src / f)
  run = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                        '--no-build-isolation', '--no-index', str(src), '-w', str(tmp_path / 'w')],
                       capture_output=True, text=True, timeout=300)
  if run.returncode and 'setuptools' in run.stderr and 'No module named' in run.stderr:
    pytest.skip('setuptools is not installed in this environment')
  assert run.returncode == 0, run.stderr
  names = zipfile.ZipFile(glob.glob(str(tmp_path / 'w' / '*.whl'))[0]).namelist()
  assert {n.split('/')[0] for n in names} == {'remat', 'remat-0.1.0.dist-info'}
  assert {'remat/targets/h100.txtpb', 'remat/targets/h200.txtpb'} <= set(names)
