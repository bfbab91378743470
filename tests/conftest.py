"""Shared fixtures: a small GPT whose depth (5, prime) leaves a remainder segment."""

import os

# Tests compile dozens of small programs; LLVM's optimisation of the CPU code is most of
# that time and changes neither buffer assignment (memory figures) nor which values
# remat saves. Added to any XLA_FLAGS given (docs/testing.md runs the suite with flags that
# change the CPU code path). Set before JAX starts its backend.
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_backend_optimization_level=0').strip()
# XLA CPU's MLIR fusion emitters take most of the rest of a small program's compile (a 5-layer
# test GPT: 3.3 s -> 1.1 s without them). The legacy emitters generate the same fusions' code
# another way; buffer assignment moves by a few bytes (docs/testing.md). Older jaxlibs lack
# the flag (and the emitters), and XLA aborts on flags it does not know.
def _jaxlib_at_least(major: int, minor: int) -> bool:
  from importlib.metadata import version
  try:
    return tuple(int(p) for p in version('jaxlib').split('.')[:2]) >= (major, minor)
  except ValueError:
    return False


if ('--xla_cpu_use_fusion_emitters' not in os.environ.get('XLA_FLAGS', '')
    and _jaxlib_at_least(0, 6)):
  os.environ['XLA_FLAGS'] += ' --xla_cpu_use_fusion_emitters=false'
# The legacy emitters' code for an operation depends on the fusion around it (measured: the same
# initial weights under two policies, or a train step with and without the NaN guard, differ in
# the last bit of a few elements). Tests of bit-equality between two different programs compile
# with XLA's default emitters, as users run: jax.jit(f, compiler_options=DEFAULT_EMITTERS).
# (xdist workers inherit the controller's XLA_FLAGS, so this reads the flags as they are now.)
DEFAULT_EMITTERS = ({'xla_cpu_use_fusion_emitters': True}
                    if '--xla_cpu_use_fusion_emitters=false' in os.environ.get('XLA_FLAGS', '')
                    else {})
# The tests measure the CPU backend; GPU targets are compiled for explicitly (remat.targets),
# so an installed jax-cuda12 plugin must not become the default backend.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gpt import GPT, GPTConfig
from remat.targets import gpu_plugin_available

SMALL = GPTConfig(vocab_size=256, max_len=16, num_layers=5, num_heads=2, d_model=32, dropout=0.1)


def pytest_collection_modifyitems(config, items):
  """Skips the GPU-target tests (marker gpu_plan) where the plugin they compile with is absent."""
  if gpu_plugin_available():
    return
  skip = pytest.mark.skip(reason='needs the jax-cuda12 plugin: pip install -e ".[gpu-plan]"')
  for item in items:
    if 'gpu_plan' in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope='session')
def small_config():
  return SMALL


@pytest.fixture(scope='session')
def small_params():
  return GPT(SMALL).init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))['params']


@pytest.fixture(scope='session')
def windows():
  """A batch of 2 byte windows of 17 tokens (16 inputs + 1 shifted target)."""
  return jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 17)), jnp.int32)


@pytest.fixture
def text_file(tmp_path):
  """A small deterministic text corpus (repetitive, so a few steps lower the loss)."""
  lines = [f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)]
  path = tmp_path / 'corpus.txt'
  path.write_text(''.join(lines))
  return path


@pytest.fixture(autouse=True, scope='session')
def _private_remat_cache(tmp_path_factory):
  """Token caches and --remat=auto answers go to a folder of this test session (each xdist
  worker its own), never the user's ~/.cache/remat: tests that damage cache entries on purpose
  must not reach another worker's run, or a train.py run beside the suite."""
  before = os.environ.get('REMAT_CACHE')
  os.environ['REMAT_CACHE'] = str(tmp_path_factory.mktemp('remat-cache'))
  yield
  if before is None:
    os.environ.pop('REMAT_CACHE', None)
  else:
    os.environ['REMAT_CACHE'] = before
