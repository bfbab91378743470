"""A refused command changes nothing in the run folder; the run's records are never dropped (issue 36).

Each refusal runs ``train.py``'s main in-process on a copy of a finished run
(byte-level, or with a BPE tokenizer trained here), and the folder is hashed
before and after: every file's path and bytes, every folder's name. A refusal
is one line on stderr, exit code 2, and the hashes are equal.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from text_fixtures import bpe_tokenizer, rows, write_jsonl
from training import cli
from training.run import rundir
from training.trainer import TrainConfig, train

pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
SMALL = dict(config='tiny', remat='sqrt', steps=4, batch_size=2, seq_len=16, lr=3e-3,
             warmup_steps=1, eval_every=4, eval_batches=1, save_every=2, memory_report=False)


def folder_hash(root: Path) -> str:
  """SHA-256 of every path under ``root`` (folders by name, files by name and bytes)."""
  h = hashlib.sha256()
  for dirpath, dirnames, filenames in sorted(os.walk(root)):
    dirnames.sort()
    h.update(f'D {os.path.relpath(dirpath, root)}\n'.encode())
    for name in sorted(filenames):
      path = Path(dirpath) / name
      h.update(f'F {path.relative_to(root)} '.encode())
      h.update(path.read_bytes() if not path.is_symlink() else os.readlink(path).encode())
  return h.hexdigest()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Two finished runs of 4 steps: byte-level on a text file, and a BPE-tokenized .jsonl run."""
  tmp = tmp_path_factory.mktemp('runs')
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv('REMAT_CACHE', str(tmp / 'cache'))
    yield _runs(tmp)


def _runs(tmp: Path) -> dict:
  corpus = tmp / 'corpus.txt'
  corpus.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  texts = [r['prompt'] + r['completion'] for r in rows(100)]
  tok = bpe_tokenizer(tmp / 'tok', texts)
  other = bpe_tokenizer(tmp / 'other', texts[::-1], vocab_size=280)
  data = write_jsonl(tmp / 'd.jsonl', [{'text': t} for t in texts])
  byte_run = TrainConfig(**SMALL, out=str(tmp / 'bytes'), data=str(corpus))
  tok_run = TrainConfig(**SMALL, out=str(tmp / 'tok-run'), data=str(data), tokenizer=str(tok))
  for cfg in (byte_run, tok_run):
    train(cfg, log=lambda *_: None, warn=pytest.fail)
  return {'bytes': byte_run, 'tok': tok_run, 'other': other, 'corpus': corpus, 'data': data}


def visible(err: str) -> list[str]:
  """The lines a terminal shows: text a carriage return went back over is gone (a progress bar
  that cleared itself), blank lines dropped."""
  return [l.split('\r')[-1].rstrip() for l in err.split('\n') if l.split('\r')[-1].strip()]


def _refused(argv, capsys, code=2) -> str:
  assert cli.main(argv) == code
  err = visible(capsys.readouterr().err)
  assert len(err) == 1 and err[0].startswith('train.py: error: '), err
  return err[0]


def _copy(runs, which, tmp_path) -> Path:
  out = tmp_path / which
  shutil.copytree(runs[which].out, out)
  return out


def _tokenizer_cases(runs):
  other, tok = runs['other'], runs['tok'].tokenizer
  return [
      # Issue 36 (1): these overwrote RUN/tokenizer/ before the refusal.
      (['--resume', '--tokenizer', str(other)], 'is not the tokenizer the run was trained with'),
      (['--resume', '--tokenizer', 'bytes'], 'not on bytes'),
      (['--tokenizer', str(other), f'--data={runs["data"]}'], 'already holds a run'),
      (['--tokenizer', str(tok), f'--data={runs["data"]}'], 'already holds a run'),
      (['--resume', '--batch-size=4'], 'was trained with --batch-size 2, not 4'),
      (['--resume', '--steps=2'], 'past --steps 2'),
      (['--resume', '--seq-len=4096'], 'exceeds config tiny max_len'),
      (['--resume', '--allow-changed=tokenizer'], 'tokenizer is not a compared setting'),
  ]


def _byte_cases(runs):
  return [
      (['--resume', '--tokenizer', str(runs['other'])], 'was trained on bytes (no tokenizer)'),
      ([f'--data={runs["corpus"]}'], 'already holds a run'),
      (['--resume', '--seed=1'], 'was trained with --seed 0, not 1'),
      (['--resume', '--lr=0.1'], 'was trained with --lr 0.003, not 0.1'),
      (['--resume', '--config=gpt2-small'], 'was trained with --config tiny, not gpt2-small'),
      (['--resume', '--dtype=bfloat16'], 'was trained with --dtype float32, not bfloat16'),
      (['--resume', '--model=vit'], 'does not match config tiny'),
      (['--resume', '--image-size=32'], '--image-size applies to vit and resnet'),
      (['--resume', '--lr=inf'], '--lr must be a finite number'),
      (['--resume', '--seed=-1'], '--seed must be'),
      (['--resume', '--data-workers=-3'], '--data-workers'),
      (['--allow-changed=lr', f'--data={runs["corpus"]}'], '--allow-changed applies to --resume'),
      (['--resume', '--allow-changed=colour'], 'colour is not a compared setting'),
      (['--resume', '--eval-batches=100000000'], '--eval-batches'),
      (['--resume', '--batch-size=1000000000'], '--batch-size'),
  ]


@pytest.mark.parametrize('which', ['tok', 'bytes'])
def test_every_refusal_leaves_the_run_folder_byte_identical(runs, tmp_path, capsys, which):
  out = _copy(runs, which, tmp_path)
  cases = _tokenizer_cases(runs) if which == 'tok' else _byte_cases(runs)
  before = folder_hash(out)
  copy_before = (out / 'tokenizer' / 'tokenizer.json').read_bytes() if which == 'tok' else None
  for extra, needle in cases:
    line = _refused([f'--out={out}'] + extra, capsys)
    assert needle in line, (extra, line)
    assert folder_hash(out) == before, (extra, line)
  if copy_before is not None:   # what training.export ships is still the run's tokenizer
    assert (out / 'tokenizer' / 'tokenizer.json').read_bytes() == copy_before


def test_the_same_tokenizer_under_another_name_resumes(runs, tmp_path, capsys):
  """Compared by digest, not by path; a resume at the saved step has nothing to do."""
  out = _copy(runs, 'tok', tmp_path)
  moved = tmp_path / 'elsewhere' / 'tokenizer.json'
  moved.parent.mkdir()
  shutil.copyfile(runs['tok'].tokenizer, moved)
  assert cli.main([f'--out={out}', '--resume', f'--tokenizer={moved}']) == 0
  assert 'nothing to do' in capsys.readouterr().out


def test_an_unreadable_run_record_refuses_a_new_run_and_is_set_aside_on_resume(runs, tmp_path,
                                                                                capsys):
  out = _copy(runs, 'bytes', tmp_path)
  text = '{"meta": {"config": "tiny"}, "saved": 4, "hist'   # damaged: cut short
  (out / 'run.json').write_text(text)
  before = folder_hash(out)
  assert 'already holds a run' in _refused([f'--out={out}', f'--data={runs["corpus"]}'], capsys)
  assert folder_hash(out) == before
  # Without its checkpoints, the unreadable record alone says the folder holds a run.
  bare = tmp_path / 'bare'
  bare.mkdir()
  shutil.copyfile(out / 'run.json', bare / 'run.json')
  for argv in ([f'--data={runs["corpus"]}'], ['--resume']):
    line = _refused([f'--out={bare}'] + argv, capsys)
    assert f"run record {bare / 'run.json'} cannot be read: not JSON" in line, line
    assert '--restart' in line and sorted(p.name for p in bare.iterdir()) == ['run.json']
  # A resume continues (the checkpoints hold the settings) and keeps the old record aside.
  assert cli.main([f'--out={out}', '--resume', '--steps=5']) == 0
  warnings = [l for l in capsys.readouterr().err.splitlines() if 'warning' in l]
  assert len(warnings) == 1 and 'run.json cannot be read' in warnings[0], warnings
  assert (out / 'run.json.unreadable').read_text() == text
  record = rundir.read_record(out)
  assert record['saved'] == 5 and record['history'][0]['event'] == 'resume'


def test_lines_of_metrics_that_are_not_rows_are_set_aside_with_one_warning(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "loss": 5}\nNOT JSON\n[1, 2]\n{"step": 2, "loss": 4}\n'
                  '{"step": 3, "lo')   # and a torn last line
  warned = []
  log = rundir.MetricsLog(tmp_path, through_step=2, warn=warned.append)
  log.close()
  assert [json.loads(l)['step'] for l in path.read_text().splitlines()] == [1, 2]
  assert (tmp_path / 'metrics.unreadable.txt').read_text() == 'NOT JSON\n[1, 2]\n{"step": 3, "lo\n'
  assert len(warned) == 1 and '3 lines' in warned[0] and 'metrics.unreadable.txt' in warned[0]
  # A torn last line alone is what a killed run leaves: kept, not reported.
  path.write_text('{"step": 1, "loss": 5}\n{"step": 2, "lo')
  warned.clear()
  rundir.MetricsLog(tmp_path, through_step=2, warn=warned.append).close()
  assert warned == [] and (tmp_path / 'metrics.unreadable.txt').read_text().endswith(
      '{"step": 2, "lo\n')


def test_restart_keeps_the_tokenizer_copy_with_the_previous_files(runs, tmp_path, capsys):
  out = _copy(runs, 'tok', tmp_path)
  assert cli.main([f'--out={out}', '--restart', f'--tokenizer={runs["other"]}', '--steps=1',
                   '--save-every=1']) == 0
  capsys.readouterr()
  assert ((out / 'previous' / '1' / 'tokenizer' / 'tokenizer.json').read_bytes()
          == Path(runs['tok'].tokenizer).read_bytes())
  assert (out / 'tokenizer' / 'tokenizer.json').read_bytes() == runs['other'].read_bytes()


def test_the_tokenizer_is_compared_by_content_whoever_named_it(tmp_path):
  """A run that took its tokenizer from --init-from resumes with that file named by --tokenizer
  (it was refused as '--tokenizer None'); a recorded file edited since is named as such (it was
  reported as 'config tiny has changed shape')."""
  import types
  from training.run import tokenizer_copy
  texts = [r['prompt'] + r['completion'] for r in rows(60)]
  hf = tmp_path / 'hf'
  bpe_tokenizer(hf, texts)
  out = tmp_path / 'run'
  out.mkdir()
  recorded = {'tokenizer': None, 'init_from': str(hf)}
  tokenizer_copy.write(types.SimpleNamespace(**recorded), out, fresh=True)
  assert (out / 'tokenizer' / 'tokenizer.json').read_bytes() == (hf / 'tokenizer.json').read_bytes()
  named = types.SimpleNamespace(tokenizer=str(hf / 'tokenizer.json'), init_from=str(hf))
  tokenizer_copy.check(named, out, recorded)   # the same file: no refusal
  bpe_tokenizer(hf, texts[::-1], vocab_size=280)   # the file the run recorded, edited since
  with pytest.raises(tokenizer_copy.TokenizerChangedError) as e:
    tokenizer_copy.check(types.SimpleNamespace(**recorded), out, recorded)
  assert f"tokenizer {hf / 'tokenizer.json'} (sha256 " in str(e.value)
  assert 'has changed since the run was trained with it' in str(e.value)
  assert f"its copy in {out / 'tokenizer'}" in str(e.value)
