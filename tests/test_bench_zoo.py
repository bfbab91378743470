"""bench.zoo and bench.device_peak: timing in one run, GPU plans, the device peak in a fresh process."""

import pytest

from bench.zoo import measure, step_memory
from models.gpt import GPTConfig
from remat.targets import get_target

SMALL = GPTConfig(vocab_size=256, max_len=32, num_layers=4, num_heads=2, d_model=32, dropout=0.1)


@pytest.mark.extended
def test_time_ratio_measured_in_one_run():
  cpu = get_target('cpu')
  none = measure(SMALL, 'none', 2, 16, cpu, run=True)
  full = measure(SMALL, 'full', 2, 16, cpu, run=True)
  assert none.step_seconds > 0 and full.step_seconds > 0


@pytest.mark.gpu_plan
# h100 goes through the same code as h200 with other device facts: kept for -m slow.
@pytest.mark.parametrize('name', [pytest.param('h100', marks=pytest.mark.slow), 'h200'])
def test_gpu_target_plans_offload_to_host(name):
  target = get_target(name)
  assert target.description.startswith(f'NVIDIA {name.upper()}')
  none, full, off = (step_memory(SMALL, s, 4, 32, target)
                     for s in ('none', 'full', 'minimal_offloaded'))
  assert full.temp < none.temp
  assert none.host_temp == 0 and off.host_temp > 0
  assert off.backend == name


@pytest.mark.extended
def test_device_peak_runs_in_a_fresh_process():
  from bench.device_peak import measured_device_peak
  got = measured_device_peak('tiny', 'full', 2, 16)
  assert got['backend'] == 'cpu' and got['peak_bytes'] is None  # CPU keeps no allocator stats
