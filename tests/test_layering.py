"""The library stands alone: remat imports no application package, and installs as remat only."""

import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ('models', 'training', 'configs', 'baselines', 'bench', 'train')

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


def test_no_remat_file_imports_the_application():
  pattern = re.compile(rf"^\s*(from|import)\s+({'|'.join(APP)})\b", re.M)
  offenders = [f'{p.name}: {m.group(0).strip()}' for p in sorted((ROOT / 'remat').glob('*.py'))
               for m in pattern.finditer(p.read_text())]
  assert offenders == []


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
