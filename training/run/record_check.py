"""A resume's checks against the run's record, before anything is compiled, restored or written.

:func:`check_record` compares the settings, the config, the model's shape and
dtype and the tokenizer with the newest checkpoint's record
(:mod:`training.run.resume_check` lists the compared settings);
:func:`check_lora` compares the adapters. Each mismatch is one line
(:class:`training.run.settings.RunError`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from configs import NamedConfig
from models.tasks import Task
from training.run import checkpoints as ckpt
from training.run import resume_check
from training.run import rundir
from training.run import tokenizer_copy
from training.run.settings import RunError, TrainConfig


def check_record(cfg: TrainConfig, named: NamedConfig, out: Path) -> tuple[int | None, dict]:
  """Checks the settings against the newest checkpoint's record.

  Runs before anything is compiled, restored or written, so a wrong flag costs nothing and
  changes nothing. ``--restart`` is not checked here: it sets the run's files aside.

  Returns:
    (the newest checkpoint's step, None if there is none; the compared
    settings that changed, all allowed by ``--allow-changed``).
  """
  if cfg.restart:
    return None, {}
  saved = ckpt.steps(out)
  held = rundir.history(out, rundir.read_record(out))
  if not cfg.resume and (saved or held):
    raise RunError(f'{out} already holds a run ({f"checkpoint {saved[0]}" if saved else held}); '
                   'pass --resume to continue it, --restart to start it over (its files move to '
                   f'{out / rundir.PREVIOUS_NAME}/), or --out for a new run')
  if not saved:
    if held:  # every checkpoint is gone: a resume must not quietly become a new run
      raise RunError(f'--resume: no checkpoint left in {out / "checkpoints"} although {held}; '
                     f'damaged ones are kept in {out / rundir.DAMAGED_NAME}; pass --restart to '
                     f'start the run over on purpose (its files move to '
                     f'{out / rundir.PREVIOUS_NAME}/), or --out for a new run')
    return None, {}
  got = ckpt.read_meta(out)
  if got is None:
    return saved[0], {}  # no readable record: restore reports each checkpoint's problem
  step, meta = got
  if not Task(named.model).is_vision:  # before the shape: another tokenizer changes the vocabulary
    tokenizer_copy.check(cfg, out, meta.get('train', {}))
  for what, was, now in (('config', meta.get('config'), named.name),
                         ('model', meta.get('arch'), named.arch)):
    if was != now:
      raise RunError(f'--resume: {out} was trained with --{what} {was}, not {now}; drop '
                     f'--{what} (or pass --{what} {was}), or pass another --out for a new run')
  changed = resume_check.check(
      resume_check.changes(meta.get('train', {}), dataclasses.asdict(cfg),
                           defaults(TrainConfig), Task(named.model).is_vision),
      resume_check.parse_allowed(cfg.allow_changed), out)
  # The record went through JSON, which turns tuples (a ResNet's stage widths) into lists; a
  # field added to the config after the run was saved reads as its default (float32 for dtype).
  # The dtype is not shape: checked on its own.
  was = json.loads(json.dumps({**defaults(type(named.model)), **(meta.get('model') or {})}))
  now = json.loads(json.dumps(dataclasses.asdict(named.model)))
  was.pop('lora', None), now.pop('lora', None)   # compared by check_lora
  was_dtype, now_dtype = was.pop('dtype', 'float32'), now.pop('dtype')
  if was != now:
    raise RunError(f'--resume: config {named.name} has changed shape since {out} was saved; '
                   'restore the config file, or pass another --out for a new run')
  if was_dtype != now_dtype:
    raise RunError(f'--resume: {out} was trained with --dtype {was_dtype}, not {now_dtype}; drop '
                   f'--dtype (or pass --dtype {was_dtype}), or pass another --out for a new run')
  if step > cfg.steps:
    raise RunError(f'--resume: {out} is at step {step}, past --steps {cfg.steps}; pass --steps '
                   f'above {step} to train further')
  return step, changed


def check_lora(meta: dict, named: NamedConfig, out: Path):
  """Raises a one-line RunError if the run in ``out`` had other adapters (or none)."""
  was = (meta.get('model') or {}).get('lora')
  now = json.loads(json.dumps(dataclasses.asdict(named.model))).get('lora')
  if was != now:   # adapters are what such a checkpoint holds: no flag changes them
    raise RunError(f'--resume: {out} was trained {lora_words(was)}, not {lora_words(now)}; '
                   'drop the --lora and --quantize flags to continue it as it was, or pass '
                   'another --out for a new run')


def lora_words(spec: dict | None) -> str:
  """'without --lora' or 'with --lora 8 --lora-alpha 16 ... --quantize nf4', from a record."""
  if not spec:
    return 'without --lora'
  words = [f"--lora {spec['rank']}", f"--lora-alpha {spec['alpha']:g}"]
  if spec.get('dropout'):
    words.append(f"--lora-dropout {spec['dropout']:g}")
  if spec.get('targets'):
    words.append(f"--lora-targets {','.join(spec['targets'])}")
  if spec.get('quantize'):
    words.append(f"--quantize {spec['quantize']}")
  return 'with ' + ' '.join(words)


def defaults(config_cls) -> dict:
  return {f.name: f.default for f in dataclasses.fields(config_cls)
          if f.default is not dataclasses.MISSING}
