"""The range of every numeric setting of a run, and which flags apply to which model.

Checked before anything is read, compiled or written, so a value out of range
is one line (exit code 2) instead of a traceback after a compile, a hang, or a
setting that is quietly ignored. Each bound says why it is there:

* step counts fit the train state's ``int32`` step counter;
* a seed is one ``jax.random.PRNGKey`` takes without aliasing: without
  ``jax_enable_x64`` it keeps 32 bits (``PRNGKey(2**32)`` is ``PRNGKey(0)``),
  and numpy's generators refuse negative seeds;
* a batch, and the held-out batches a run keeps in memory, must fit this
  machine's memory (``--batch-size 1000000000`` was a traceback, ``--eval-batches
  100000000`` a hang while the batches were drawn);
* ``--data-workers`` between 0 and the machine's cores (more processes than
  cores decode no faster).

Flags of another model family are refused, not ignored: ``--seq-len`` and
``--tokenizer`` apply to language models, ``--image-size`` and
``--data-workers`` to vision models.
"""

from __future__ import annotations

import math
import os

MAX_COUNT = 2**31 - 1   # the train state's step is int32
AUGMENTS = ('none', 'flip', 'crop', 'crop+flip')   # --augment (training/data/image_folder.py)
MAX_SEED = 2**32 - 1    # what PRNGKey keeps without jax_enable_x64
# Bytes per row of a language-model batch: tokens, segment ids, positions and loss mask,
# int32 each, per token of a window of seq_len + 1.
LM_BYTES_PER_TOKEN = 16
LM_ONLY = ('seq_len', 'tokenizer', 'eval_generate')  # --eval-data: text or images
VISION_ONLY = ('image_size', 'data_workers', 'augment', 'crop_scale')


class BoundsError(ValueError):
  """A setting out of its range, or a flag of another model; the message is one line."""


def flag(name: str) -> str:
  return '--' + name.replace('_', '-')


def _check_int(name: str, value, low: int, high: int, why: str = ''):
  if value < low:
    raise BoundsError(f'{flag(name)} must be >= {low}, got {value}')
  if value > high:
    raise BoundsError(f'{flag(name)} must be <= {high}{why}, got {value}')


def check_seed(value, name: str = 'seed'):
  """0 <= seed <= 2**32 - 1 (module docstring)."""
  _check_int(name, value, 0, MAX_SEED, ' (a JAX PRNGKey keeps 32 bits)')


def check_numbers(cfg):
  """Every count, size, seed and rate of ``cfg`` (a TrainConfig) in its range.

  Raises:
    BoundsError: one line naming the flag, its range and the value given.
  """
  for name in ('steps', 'batch_size', 'seq_len', 'eval_every', 'eval_batches', 'save_every',
               'spike_patience', 'grad_accum'):
    _check_int(name, getattr(cfg, name), 1, MAX_COUNT)
  for name in ('warmup_steps', 'skip_nonfinite', 'eval_generate'):
    _check_int(name, getattr(cfg, name), 0, MAX_COUNT)
  if cfg.augment not in AUGMENTS:
    raise BoundsError(f"--augment must be one of {', '.join(AUGMENTS)}, got {cfg.augment!r}")
  if cfg.crop_scale is not None:
    low, high = cfg.crop_scale
    if not (0 < low <= high <= 1):
      raise BoundsError(f'--crop-scale MIN,MAX must have 0 < MIN <= MAX <= 1 (fractions of the '
                        f'image area), got {low:g},{high:g}')
    if 'crop' not in cfg.augment:
      raise BoundsError(f'--crop-scale applies to --augment crop or crop+flip, not '
                        f'{cfg.augment}')
  if cfg.early_stop is not None:
    _check_int('early_stop', cfg.early_stop, 1, MAX_COUNT)
  if cfg.image_size is not None:   # 0 used to mean "the config's" and trained at 32
    _check_int('image_size', cfg.image_size, 1, MAX_COUNT)
  check_seed(cfg.seed)
  if cfg.data_workers is not None:
    cores = os.cpu_count() or 1
    _check_int('data_workers', cfg.data_workers, 0, cores, ' (the cores of this machine)')
  # NaN fails every comparison, so each check is written to pass only for good values.
  for name, low, strict in (('lr', 0.0, True), ('grad_clip', 0.0, True),
                            ('weight_decay', 0.0, False)):
    value = getattr(cfg, name)
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
      raise BoundsError(f"{flag(name)} must be a finite number {'>' if strict else '>='} {low:g}, "
                        f'got {value}')
  # The guard's thresholds may be inf (the guard off), never NaN or below their floor.
  for name, low in (('spike_factor', 1.0), ('spike_margin', 0.0)):
    if not getattr(cfg, name) >= low:
      raise BoundsError(f'{flag(name)} must be >= {low:g} (inf turns the guard off), got '
                        f'{getattr(cfg, name)}')
  if cfg.resume and cfg.restart:
    raise BoundsError('--resume continues a run and --restart starts it over; pass one of them')
  if cfg.allow_changed and not cfg.resume:
    raise BoundsError('--allow-changed applies to --resume (the changes a resumed run accepts); '
                      'a new run or --restart takes any setting: drop --allow-changed')


def check_applicable(arch: str, config: str, given) -> None:
  """Refuses flags ``given`` (names of the flags on the command line) that ``arch`` ignores.

  Raises:
    BoundsError: one line naming the flag and the models it applies to.
  """
  vision = arch in ('vit', 'resnet')
  for name in (LM_ONLY if vision else VISION_ONLY):
    if name in given:
      family = 'gpt and llama' if vision else 'vit and resnet'
      instead = {'seq_len': ' (use --image-size)', 'image_size': ' (use --seq-len)'}.get(name, '')
      raise BoundsError(f'{flag(name)} applies to {family} configs; {config} is a {arch} config'
                        f'{instead}')


def physical_memory() -> int | None:
  """Bytes of memory of this machine (None where the OS does not say)."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def _size(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'):
    if n < 1024 or unit == 'PiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1024
  return f'{n} B'


def check_batch_memory(batch_size: int, row_bytes: int, what: str):
  """One batch of host arrays must fit this machine's memory.

  Args:
    row_bytes: bytes of one row of the batch; ``what`` describes a row ("129 tokens").
  """
  total, memory = batch_size * row_bytes, physical_memory()
  if memory is not None and total > memory:
    raise BoundsError(f'--batch-size {batch_size}: one batch of {batch_size} x {what} is '
                      f'{_size(total)} of host arrays, more than the {_size(memory)} of memory of '
                      'this machine')


def check_held_out_memory(num_batches: int, batch_size: int, row_bytes: int):
  """The held-out batches, which a run keeps for every evaluation, must fit in memory."""
  total, memory = num_batches * batch_size * row_bytes, physical_memory()
  if memory is not None and total > memory // 2:
    fit = max(1, memory // 2 // max(1, batch_size * row_bytes))
    raise BoundsError(f'--eval-batches {num_batches}: {num_batches} held-out batches of '
                      f'{batch_size} would hold {_size(total)} in memory, more than half of the '
                      f'{_size(memory)} of this machine; pass --eval-batches {fit} or fewer')
