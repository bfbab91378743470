"""The run folder's copy of its tokenizer: written once, with the run, and compared by digest.

``training.export`` ships ``<out>/tokenizer/`` beside the weights and
``training.sample`` decodes with it, so the copy must be the tokenizer the
checkpoints were trained with: a model's ids decoded by another tokenizer are
garbage. Hence:

* the copy is written when a run starts from step 0 (a new run, ``--restart``,
  or a resume of a run that never saved), and on a resume only when it is
  missing; never by a command that is refused (the trainer writes it after
  every check);
* a resume compares the tokenizer it would train with against the run's, by a
  SHA-256 digest of the files (``tokenizer.json`` and its companions), not by
  path: the same file under another name resumes, an edited file or another
  tokenizer is refused with one line. Changing a run's tokenizer is not a
  setting ``--allow-changed`` accepts (the ids would mean other text).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import types
from pathlib import Path

from training.data.text_source import tokenizer_for_run, tokenizer_path
from training.data.tokenizer import COMPANION_FILES, TOKENIZER_FILE, find_tokenizer
from training.run import resume_check
from training.run.rundir import TOKENIZER_NAME

FILES = (TOKENIZER_FILE,) + COMPANION_FILES


class TokenizerChangedError(ValueError):
  """A resume whose tokenizer is not the run's; the message is one line."""


def _files(tokenizer_json: Path) -> dict[str, Path]:
  """The files of a tokenizer: its ``tokenizer.json`` and the companions beside it."""
  found = {TOKENIZER_FILE: tokenizer_json}
  for name in COMPANION_FILES:
    if (tokenizer_json.parent / name).is_file():
      found[name] = tokenizer_json.parent / name
  return found


def digest(tokenizer_json: Path) -> str:
  """SHA-256 over the names and bytes of a tokenizer's files (its companions included: the
  end-of-text token is read from ``tokenizer_config.json``)."""
  h = hashlib.sha256()
  for name, path in sorted(_files(Path(tokenizer_json)).items()):
    data = path.read_bytes()
    h.update(f'{name}\0{len(data)}\0'.encode())
    h.update(data)
  return h.hexdigest()


def copy_path(out: Path) -> Path:
  """``<out>/tokenizer/tokenizer.json``, the copy's main file."""
  return Path(out) / TOKENIZER_NAME / TOKENIZER_FILE


def check(cfg, out: Path, recorded: dict):
  """Refuses a resume whose tokenizer is not the one ``out`` was trained with; writes nothing.

  Args:
    cfg: the resumed run's settings (``tokenizer``, ``init_from``).
    out: the run folder.
    recorded: the ``train`` settings of the run's record (what it was started with).

  Raises:
    TokenizerChangedError: one line naming both tokenizers and the ways on.
  """
  was_path = tokenizer_path(types.SimpleNamespace(tokenizer=recorded.get('tokenizer'),
                                                  init_from=recorded.get('init_from')))
  now = tokenizer_for_run(cfg)[0]
  copy = copy_path(out)
  ways = ("drop --tokenizer (the run's record supplies it), or pass another --out for a new run; "
          "a run's tokenizer cannot be changed")
  if was_path is None:  # a byte-level run
    if now.path is not None:
      raise TokenizerChangedError(f'--resume: {out} was trained on bytes (no tokenizer), not with '
                                  f'tokenizer {now.path}; {ways}')
    return
  if now.path is None:
    raise TokenizerChangedError(f'--resume: {out} was trained with tokenizer {was_path} (its copy '
                                f'in {copy.parent}), not on bytes; {ways}')
  if copy.is_file():
    expected, where = digest(copy), f'its copy in {copy.parent}'
  elif find_tokenizer(was_path) is not None:   # a run from before the copy: the recorded file
    expected, where = digest(find_tokenizer(was_path)), str(was_path)
  else:
    return   # nothing left to compare with; the copy is written from this tokenizer
  got = digest(now.path)
  if got != expected:
    what = ('has changed since the run was trained with it' if resume_check.same_path(
        was_path, now.path) else 'is not the tokenizer the run was trained with')
    raise TokenizerChangedError(
        f'--resume: tokenizer {now.path} (sha256 {got[:12]}) {what} ({where}, sha256 '
        f'{expected[:12]}); {ways}')


def write(cfg, out: Path, fresh: bool):
  """Writes the run's tokenizer files into ``<out>/tokenizer/`` (each file atomically).

  Args:
    fresh: the run starts from step 0: the copy is replaced (no checkpoint was trained
      with an earlier one). Otherwise it is written only if missing.
  """
  tok = tokenizer_for_run(cfg)[0]
  dest = Path(out) / TOKENIZER_NAME
  if tok.path is None:   # bytes: no tokenizer to keep; a stale copy of a run that never saved goes
    if fresh and dest.is_dir():
      shutil.rmtree(dest)
    return
  if not fresh and copy_path(out).is_file():
    return
  files = _files(Path(tok.path))
  dest.mkdir(exist_ok=True)
  for name, src in files.items():
    tmp = dest / f'.{name}.tmp'
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest / name)
  for name in FILES:   # a companion the new tokenizer does not have would pair with the wrong file
    if name not in files and (dest / name).exists():
      (dest / name).unlink()
