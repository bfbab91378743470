"""Orbax checkpoints that can be trusted: never non-finite, digest-verified, with fallback restore.

Each checkpoint holds two items: ``state`` (the :class:`~training.step.train_step.TrainState`
without a LoRA run's frozen base, which the run loads again from its source and
checks against the digest its record holds) and ``meta`` (JSON: config, model,
policy, settings, and ``digest``, a SHA-256 of the saved arrays). Orbax writes a
step into a temporary folder and renames it when complete, so a kill mid-save leaves no half checkpoint under a step name;
the writer removes such leftovers when it opens the folder.

Restore walks the steps newest first and takes the first that restores, whose
arrays match the recorded digest and are finite; a damaged newer one is moved
to ``<out>/damaged/`` (kept for inspection, out of the way of the steps the run
re-saves) with a warning naming what was wrong.

A save is one step that either completes or leaves only a temporary folder:
SIGINT and SIGTERM wait for it to finish (then interrupt the run), and a full
disk removes the partial folder and raises :class:`~training.run.rundir.DiskFullError`.
Orbax's own reports of the failure are kept off the terminal
(:mod:`training.run.orbax_noise`); the caller reports it in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import shutil
import signal
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from training.run import orbax_noise, rundir

MAX_TO_KEEP = 2
TMP_SUFFIX = '.orbax-checkpoint-tmp'  # orbax's name for a step folder being written


class CheckpointError(ValueError):
  """No usable checkpoint, or a state that must not be saved; the message is one line."""


def folder(out: Path) -> Path:
  return out.resolve() / 'checkpoints'


def manager(out: Path, save_every: int = 1, writer: bool = False,
            keep: int = MAX_TO_KEEP) -> ocp.CheckpointManager:
  """An orbax manager of ``<out>/checkpoints``.

  Only the run holding the folder's lock is a ``writer``: it creates the folder
  and removes temporary folders of interrupted saves. A reader must not, as
  such a folder may be the save another process is writing right now. ``keep``: the
  newest steps kept (the best step of ``--keep-best`` keeps one).
  """
  if writer:
    _remove_interrupted_saves(out)
  opts = ocp.CheckpointManagerOptions(
      save_interval_steps=save_every, max_to_keep=keep, enable_async_checkpointing=False,
      create=writer)
  return ocp.CheckpointManager(folder(out), options=opts, item_names=('state', 'meta'))


def _remove_interrupted_saves(out: Path):
  # Orbax's own cleanup_tmp_directories runs in the background, unawaited; a run must
  # know the folder is clean before it counts its checkpoints.
  for tmp in folder(out).glob(f'*{TMP_SUFFIX}*'):
    shutil.rmtree(tmp, ignore_errors=True)


def steps(out: Path) -> list[int]:
  """Complete checkpoint steps in ``out``, newest first (interrupted saves do not count)."""
  if not folder(out).is_dir():
    return []
  mngr = manager(out)
  found = sorted(mngr.all_steps(), reverse=True)
  mngr.close()
  return found


def host(state):
  """``state`` as whole host (numpy) arrays, however it is sharded.

  Arrays on this process's devices are copied; arrays sharded across processes
  are gathered (a collective: every process must call it). The digest is over
  these whole arrays, so it does not depend on the mesh that held them and a
  checkpoint saved on one mesh verifies on another.
  """
  leaves = jax.tree_util.tree_leaves(state)
  if all(getattr(a, 'is_fully_addressable', True) for a in leaves):
    return jax.device_get(state)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(state, tiled=True)


def digest(state) -> str:
  """SHA-256 over every array of ``state`` (tree path, dtype, shape and bytes), on host copies."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(host(state))[0]:
    a = np.ascontiguousarray(leaf)
    h.update(f'{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape};'.encode())
    h.update(a.view(np.uint8).reshape(-1) if a.size else b'')
  return h.hexdigest()


def nonfinite(state) -> list[str]:
  """Tree paths of floating-point arrays in ``state`` holding a NaN or an infinity."""
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(host(state))[0]:
    a = np.asarray(leaf)
    if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
      bad.append(jax.tree_util.keystr(path))
  return bad


def _saved(state):
  """``state`` without its frozen base (a LoRA run's), which no checkpoint holds."""
  return state.replace(frozen=None) if getattr(state, 'frozen', None) is not None else state


def _fields(state) -> dict:
  """The saved fields by name: what orbax writes (a train state written before the frozen
  field existed restores into the same names)."""
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != 'frozen'}


def save(mngr: ocp.CheckpointManager, state, meta: dict, force: bool = False) -> bool:
  """Saves ``state`` if its step is due (or ``force``); returns whether it saved.

  Raises:
    CheckpointError: the state holds non-finite values; nothing is written, so
      no good checkpoint is rotated out by it.
  """
  step = int(state.step)
  if not (force or mngr.should_save(step)):
    return False
  state = _saved(state)
  whole = host(state)
  bad = nonfinite(whole)
  if bad:
    raise CheckpointError(f'step {step}: non-finite values in {bad[0]}'
                          f'{f" and {len(bad) - 1} more arrays" if len(bad) > 1 else ""}; '
                          'not saved')
  args = ocp.args.Composite(state=ocp.args.StandardSave(_fields(state)),
                            meta=ocp.args.JsonSave({**meta, 'digest': digest(whole)}))
  try:
    with orbax_noise.quiet():
      mngr.save(step, force=force, args=args)
  except Exception as e:  # pylint: disable=broad-except
    if not rundir.is_disk_full(e):
      raise
    orbax_noise.after_failed_save()
    where = Path(mngr.directory)
    for tmp in where.glob(f'{step}{TMP_SUFFIX}*'):  # give the space back; it is no checkpoint
      shutil.rmtree(tmp, ignore_errors=True)
    raise rundir.DiskFullError(f'no space left on device writing checkpoint {step} to {where} '
                               f'({_free(where)} free after removing its partial files)') from None
  return True


def _free(path: Path) -> str:
  free = rundir.free_bytes(path)
  return 'unknown' if free is None else f'{free / 2**20:.1f} MiB'


def close(mngr: ocp.CheckpointManager):
  """Closes ``mngr`` quietly (after a failed save its threads may still report)."""
  with orbax_noise.quiet():
    try:
      mngr.close()
    except Exception:  # pylint: disable=broad-except  (the failure was already reported)
      pass


@contextlib.contextmanager
def deferred_interrupts(on_second=None):
  """SIGINT and SIGTERM wait until the block ends, then raise KeyboardInterrupt.

  Wraps a save: an interrupt in the middle would leave orbax's writer threads
  running while the interpreter shuts down (a traceback after the clean
  "interrupted" line). A second signal interrupts at once: ``on_second()``
  (which should end the process without the interpreter's teardown, where
  those threads report: 421 lines), else KeyboardInterrupt. The temporary
  folder it leaves is no checkpoint, and the next run removes it.
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set from the main thread
    return
  got = []

  def handler(signum, frame):
    if got:
      if on_second is not None:
        on_second()
      raise KeyboardInterrupt
    got.append(signum)
  old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  if got:
    raise KeyboardInterrupt


def set_aside(out: Path, step: int) -> Path:
  """Moves checkpoint ``step`` to ``<out>/damaged/`` (kept, out of the rotation); returns where."""
  return _set_aside(out, step)


def read_meta(out: Path) -> tuple[int, dict] | None:
  """(step, meta) of the newest checkpoint whose meta reads, or None; warns of nothing."""
  for step in steps(out):
    try:
      return step, _restore(out, step, meta=ocp.args.JsonRestore()).meta
    except Exception:  # pylint: disable=broad-except  (a damaged one: restore reports it)
      continue
  return None


# A reader (training.export, training.sample) lists the steps again when one it was restoring
# disappeared: the run that writes them rotated it out (max_to_keep) and saved a newer one.
RESCANS = 5


def restore(out: Path, state_shape, warn, set_aside: bool = True,
            what: str = '--resume') -> tuple[object, dict]:
  """(state, meta) of the newest checkpoint that restores, verifies and is finite.

  A LoRA run's state comes back without its frozen base (``frozen`` None).
  Newer checkpoints that fail are moved to ``<out>/damaged/`` (unless not
  ``set_aside``: a reader such as ``training.export`` leaves the run as it is),
  each with one ``warn`` line naming the step and the problem; ``what`` names
  the caller in the error. A reader whose step vanished while it read it (a
  training run rotated it out) lists the steps again.

  Raises:
    CheckpointError: no checkpoint in ``out`` restores.
  """
  problems, tried = [], set()
  for _ in range(RESCANS):
    rotated = False
    for step in steps(out):
      if step in tried:
        continue
      try:
        meta = _restore_item(out, step, 'meta', ocp.args.JsonRestore(), 'meta/metadata')
        # Shardings in state_shape place the arrays on this run's mesh, whatever mesh saved them.
        template = _saved(state_shape)
        state = template.replace(**_restore_item(out, step, 'state',
                                                 ocp.args.StandardRestore(_fields(template))))
        _verify(state, meta)
      except Exception as e:  # pylint: disable=broad-except
        if not set_aside and not (folder(out) / str(step)).exists():
          rotated = True   # not damaged: gone; a newer step has taken its place
          break
        # Damaged files surface as many types (ValueError, FileNotFoundError, JSONDecodeError,
        # XlaRuntimeError from tensorstore, ...); each means this step cannot be used.
        tried.add(step)
        problems.append(f'step {step}: {_one_line(e)}')
        moved = f'moved to {_set_aside(out, step)}, ' if set_aside else ''
        warn(f'checkpoint {step} in {folder(out)} cannot be used ({_one_line(e)}); '
             f'{moved}trying the previous one')
        continue
      return state, meta
    if not rotated:
      break
  advice = (f'; they are kept in {out / rundir.DAMAGED_NAME}; pass --restart to start the run '
            f'over on purpose (its files move to {out / rundir.PREVIOUS_NAME}/), or --out for a '
            'new run') if set_aside else ''
  raise CheckpointError(f'{what}: no intact checkpoint in {folder(out)}'
                        + (f" ({'; '.join(problems)})" if problems else '') + advice)


def _restore(out: Path, step: int, **items):
  mngr = manager(out)
  # Orbax logs a failed read at ERROR level with a traceback before raising; the
  # caller reports the failure in one line instead.
  logger = logging.getLogger('absl')
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    return mngr.restore(step, args=ocp.args.Composite(**items))
  finally:
    logger.setLevel(level)
    mngr.close()


def _restore_item(out: Path, step: int, name: str, args, label: str | None = None):
  try:
    return getattr(_restore(out, step, **{name: args}), name)
  except Exception as e:  # pylint: disable=broad-except  (name the item; orbax's text may not)
    raise CheckpointError(f'{label or name}: {_one_line(e)}') from e


def _verify(state, meta: dict):
  if not isinstance(meta, dict) or 'config' not in meta:
    raise CheckpointError('meta: not a run record')
  if 'digest' in meta and digest(state) != meta['digest']:  # older checkpoints have none
    raise CheckpointError('state: the arrays do not match the SHA-256 digest recorded when '
                          'they were saved')
  bad = nonfinite(state)
  if bad:
    raise CheckpointError(f'state: non-finite values in {bad[0]}')


def _set_aside(out: Path, step: int) -> Path:
  dest = out / rundir.DAMAGED_NAME / str(step)
  if jax.process_index() != 0:  # one process moves it; the others only skip it
    return dest
  n = 1
  while dest.exists():
    n += 1
    dest = out / rundir.DAMAGED_NAME / f'{step}.{n}'
  dest.parent.mkdir(exist_ok=True)
  shutil.move(str(folder(out) / str(step)), dest)
  return dest


def _one_line(e: BaseException) -> str:
  if isinstance(e, CheckpointError):
    return str(e)
  # TensorStore appends a long dump of its internals; its first sentence says what failed.
  text = ' '.join(str(e).split(' See full TensorStore details')[0].split())
  text = text if len(text) <= 200 else text[:197] + '...'
  return f'{type(e).__name__}: {text}' if text else type(e).__name__
