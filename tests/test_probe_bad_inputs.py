"""The probe of issue 36: 150+ bad inputs, each one line, the right exit code, nothing written (slow).

Every case runs as a person runs it: a fresh process of ``train.py``,
``python -m training.export`` or ``python -m training.sample``, from an empty
working folder, with the token cache inside the probed workspace. Before and
after each case the whole workspace (finished runs, data, tokenizers, the token
cache, the working folder, the case's own inputs) is hashed:

* a refusal (exit code 2) prints one line on stderr (``PROG: ...``) and
  leaves the hash unchanged;
* a damaged token-cache entry (exit code 0, a resume with nothing to do) is
  one warning line; the run folder is unchanged and the entry verifies after.

Areas: ``train.py`` flags on a new run, refusals on a finished run, ``.jsonl``
rows, tokenizers, Hugging Face folders, image folders, cache damage,
``training.export`` and ``training.sample``. ``test_the_probe_covers_150_inputs``
(default suite) counts the cases without running them.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from test_image_folder import write_folder
from test_refusals import folder_hash, visible
from test_train import _plugin_notice
from text_fixtures import bpe_tokenizer, rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
PROGS = {'train': [str(ROOT / 'train.py')], 'export': ['-m', 'training.export'],
         'sample': ['-m', 'training.sample']}
GPT = ['--steps=2', '--batch-size=2', '--seq-len=16', '--eval-batches=1', '--no-memory-report']
VIT = ['--model=vit', '--steps=2', '--batch-size=2', '--eval-batches=1', '--no-memory-report']


@dataclasses.dataclass(frozen=True)
class Case:
  """One bad input: ``argv`` is formatted with the workspace's paths (``{ws}``, ``{bytes}``,
  ...) and ``{x}``, the case's own folder, which ``prepare(x, paths)`` fills first."""
  area: str
  prog: str
  argv: tuple[str, ...]
  needle: str = ''
  code: int = 2
  prepare: Callable[[Path, dict], None] | None = None
  warnings: int = 0   # exit 0 cases: the warning lines expected
  env: dict = dataclasses.field(default_factory=dict)   # formatted as argv


def _c(area, prog, argv, needle='', **kw) -> Case:
  return Case(area, prog, tuple(argv), needle, **kw)


# --- what the cases prepare ------------------------------------------------------------------


def _jsonl(*lines) -> Callable:
  def prepare(x: Path, paths: dict):
    (x / 'd.jsonl').write_text(json.dumps({'text': 'fine ' * 30}) + '\n'
                               + ''.join(l + '\n' for l in lines))
  return prepare


def _file(name: str, content: bytes) -> Callable:
  def prepare(x: Path, paths: dict):
    (x / name).parent.mkdir(parents=True, exist_ok=True)
    (x / name).write_bytes(content)
  return prepare


def _images(counts=None, then=None) -> Callable:
  def prepare(x: Path, paths: dict):
    write_folder(x / 'img', counts or {'train': 2, 'val': 1})
    if then:
      then(x / 'img')
  return prepare


def _no_eot_tokenizer(x: Path, paths: dict):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel()
  tok.train_from_iterator(['a b c'] * 10, trainers.BpeTrainer(vocab_size=260, show_progress=False))
  tok.save(str(x / 'tokenizer.json'))


def _copy_run(which: str, then=None) -> Callable:
  def prepare(x: Path, paths: dict):
    shutil.copytree(paths[which], x / 'run')
    if then:
      then(x / 'run')
  return prepare


def _damage_checkpoints(run: Path):
  for step in (run / 'checkpoints').iterdir():
    if step.name.isdigit():
      for f in (step / 'state').rglob('*'):
        if f.is_file() and f.stat().st_size > 1000:
          f.write_bytes(b'\0' * f.stat().st_size)


def _set_checkpoints_aside(run: Path):
  (run / 'damaged').mkdir()
  for step in list((run / 'checkpoints').iterdir()):
    if step.name.isdigit():
      step.rename(run / 'damaged' / step.name)
  (run / 'checkpoints').rmdir()


def _torch_bin_only(x: Path, paths: dict):
  (x / 'hf').mkdir()
  (x / 'hf' / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
  (x / 'hf' / 'pytorch_model.bin').write_bytes(b'a pickle, never loaded')


def _hf_config(config) -> Callable:
  def prepare(x: Path, paths: dict):
    shutil.copytree(paths['llama'], x / 'hf')
    (x / 'hf' / 'config.json').write_text(config if isinstance(config, str)
                                          else json.dumps(config(json.loads(
                                              (paths['llama'] / 'config.json').read_text()))))
  return prepare


def _huge_image(img: Path):
  Image.new('1', (9500, 9500)).save(img / 'train' / 'red_disk' / 'huge.png')


def _all_unreadable(img: Path):
  for f in img.rglob('*.png'):
    f.write_bytes(b'not a png')


# --- the cases -------------------------------------------------------------------------------


def _train_flags() -> list[Case]:
  """Flags of a new run (``--out {x}/out``, never created)."""
  bad = [
      ('--steps=abc', "--steps: 'abc' is not an integer"), ('--steps=0', '--steps must be >= 1'),
      ('--steps=-5', '--steps must be >= 1'), ('--steps=2147483648', '--steps must be <='),
      ('--steps=1e3', "'1e3' is not an integer"), ('--batch-size=0', '--batch-size must be >= 1'),
      ('--batch-size=-1', '--batch-size must be >= 1'),
      ('--batch-size=1000000000', 'more than the'), ('--batch-size=x', '--batch-size'),
      ('--seq-len=0', '--seq-len must be >= 1'), ('--seq-len=-1', '--seq-len must be >= 1'),
      ('--seq-len=100000', 'exceeds config tiny max_len'), ('--seq-len=x', '--seq-len'),
      ('--lr=0', '--lr must be a finite number > 0'), ('--lr=-1', '--lr must be'),
      ('--lr=inf', '--lr must be'), ('--lr=nan', '--lr must be'), ('--lr=fast', '--lr'),
      ('--grad-clip=0', '--grad-clip must be'), ('--grad-clip=nan', '--grad-clip must be'),
      ('--grad-clip=-1', '--grad-clip must be'), ('--weight-decay=-0.1', '--weight-decay must'),
      ('--weight-decay=inf', '--weight-decay must'), ('--seed=-1', '--seed must be >= 0'),
      ('--seed=4294967296', '--seed must be <= 4294967295'),
      ('--seed=18446744073709551617', '--seed must be <='), ('--seed=x', '--seed'),
      ('--eval-every=0', '--eval-every must be >= 1'),
      ('--eval-batches=0', '--eval-batches must be >= 1'),
      ('--eval-batches=100000000', '--eval-batches 100000000'),
      ('--save-every=0', '--save-every must be >= 1'), ('--save-every=-2', '--save-every'),
      ('--warmup-steps=-1', '--warmup-steps must be >= 0'),
      ('--skip-nonfinite=-1', '--skip-nonfinite must be >= 0'),
      ('--spike-factor=0.5', '--spike-factor must be >= 1'),
      ('--spike-factor=nan', '--spike-factor must be'), ('--spike-margin=-1', '--spike-margin'),
      ('--spike-patience=0', '--spike-patience must be >= 1'),
      ('--image-size=32', '--image-size applies to vit and resnet'),
      ('--data-workers=2', '--data-workers applies to vit and resnet'),
      ('--allow-changed=lr', '--allow-changed applies to --resume'),
      ('--allow-changed=colour', '--allow-changed'),
      ('--remat=bogus', 'bogus'), ('--remat=names:nope', 'nope'), ('--remat=seg:0', 'seg:0'),
      ('--remat=seg:999', '999'), ('--remat=auto:abc', 'auto:abc'), ('--model=nope', 'nope'),
      ('--config=nope', 'nope'), ('--dtype=float8', 'float8'), ('--mesh=bogus', '--mesh'),
      ('--colour=red', 'unrecognized arguments'), ('--steps', 'expected one argument'),
      ('--tokenizer={x}/missing', "--tokenizer '"), ('--data={x}/missing', 'does not exist'),
      ('--data=/dev/null', 'is not a regular file or a folder'),
  ]
  cases = [_c('train.py flags', 'train', GPT + [a, '--out={x}/out'], n) for a, n in bad]
  vision = [
      ('--image-size=0', '--image-size must be >= 1'), ('--image-size=-8', '--image-size'),
      ('--image-size=30', 'multiple of its patch size'), ('--seq-len=16', '--seq-len applies to'),
      ('--tokenizer=bytes', '--tokenizer applies to'), ('--data-workers=-3', '--data-workers'),
      ('--data-workers=100000', '--data-workers must be <='),
      ('--eval-batches=100000000', '--eval-batches 100000000'),
      ('--batch-size=1000000000', 'more than the'), ('--config=tiny', 'does not match config'),
  ]
  cases += [_c('train.py flags', 'train', VIT + [a, '--out={x}/out'], n) for a, n in vision]
  cases += [
      _c('train.py flags', 'train', ['--model=resnet', '--image-size=16', '--out={x}/out'],
         '--image-size must be >= 32'),
      _c('train.py flags', 'train', GPT + ['--resume', '--restart'], 'not allowed with'),
      _c('train.py flags', 'train', GPT + ['--resume', '--out={x}/empty'], 'no checkpoint in',
         prepare=lambda x, p: (x / 'empty').mkdir()),
      _c('train.py flags', 'train', GPT + ['--out={x}/f'], 'is a file, not a folder',
         prepare=_file('f', b'x')),
      _c('train.py flags', 'train', GPT + ['--out={x}/f/run'], 'is a file',
         prepare=_file('f', b'x')),
      _c('train.py flags', 'train', GPT + ['--out={x}/' + 'n' * 300], 'longer than 255 bytes'),
  ]
  return cases


def _refusals() -> list[Case]:
  """A finished run (a copy in ``{x}/run``) and a flag it refuses."""
  on_bytes = [
      ('--resume', '--batch-size=4', 'was trained with --batch-size 2, not 4'),
      ('--resume', '--seq-len=8', 'was trained with --seq-len 16, not 8'),
      ('--resume', '--seed=1', '--seed 0, not 1'), ('--resume', '--lr=0.1', '--lr'),
      ('--resume', '--warmup-steps=5', '--warmup-steps'),
      ('--resume', '--weight-decay=0.5', '--weight-decay'),
      ('--resume', '--grad-clip=2', '--grad-clip'), ('--resume', '--data={data}', '--data'),
      ('--resume', '--config=gpt2-small', '--config tiny, not gpt2-small'),
      ('--resume', '--model=vit', 'does not match config tiny'),
      ('--resume', '--dtype=bfloat16', '--dtype float32, not bfloat16'),
      ('--resume', '--steps=2', 'past --steps 2'),
      ('--resume', '--tokenizer={tok}', 'was trained on bytes'),
      ('--resume', '--allow-changed=colour', 'colour is not a compared setting'),
      ('--resume', '--image-size=32', '--image-size applies to'),
      ('--resume', '--eval-batches=100000000', '--eval-batches'),
      ('--data={corpus}', '--steps=8', 'already holds a run'),
  ]
  cases = [_c('refusals', 'train', ['--out={x}/run', *a], n, prepare=_copy_run('bytes'))
           for *a, n in on_bytes]
  on_tok = [
      ('--resume', '--tokenizer={tok2}', 'is not the tokenizer the run was trained with'),
      ('--resume', '--tokenizer=bytes', 'not on bytes'),
      ('--tokenizer={tok2}', '--data={jsonl}', 'already holds a run'),
      ('--resume', '--allow-changed=tokenizer', 'tokenizer is not a compared setting'),
      ('--resume', '--batch-size=3', '--batch-size 2, not 3'),
  ]
  cases += [_c('refusals', 'train', ['--out={x}/run', *a], n, prepare=_copy_run('tok_run'))
            for *a, n in on_tok]
  cases += [
      _c('refusals', 'train', ['--out={x}/run', '--resume'], 'no checkpoint left',
         prepare=_copy_run('bytes', _set_checkpoints_aside)),
      _c('refusals', 'train', ['--out={x}/run', '--data={corpus}'], 'already holds a run',
         prepare=_copy_run('bytes', lambda r: (r / 'run.json').write_text('{"sav'))),
      _c('refusals', 'train', ['--out={x}/run', '--tokenizer={tok}', '--data={jsonl}',
                               '--resume', '--steps=9'], 'tokenizer',
         prepare=_copy_run('tok_run', lambda r: (r / 'tokenizer' / 'tokenizer.json').write_text(
             (r / 'tokenizer' / 'tokenizer.json').read_text().replace('"<|endoftext|>"',
                                                                     '"<|endoftext|> "', 1)))),
      _c('refusals', 'train', ['--out={x}/run', '--resume'], 'is in use by another train.py run',
         prepare=_copy_run('bytes', _hold_lock)),
  ]
  return cases


HELD = []   # the lock files held by this process while a case runs


def _hold_lock(run: Path):
  fd = os.open(run / '.lock', os.O_RDWR)
  fcntl.flock(fd, fcntl.LOCK_EX)
  HELD.append(fd)


def _rows_cases() -> list[Case]:
  bad = ['not json', '[1, 2]', '5', '"text"', 'null', '{}', '{"prompt": "x"}',
         '{"completion": "x"}', '{"text": 5}', '{"text": null}', '{"prompt": 1, "completion": "x"}',
         '{"text": ["a"]}', '{"text": "cut', '{"text": NaN}', '{"prompt": "a", "completion": 2}',
         '{"txt": "typo"}', 'true', '{"text": {"nested": 1}}', '\x00\x01\x02']
  cases = [_c('jsonl rows', 'train', GPT + ['--data={x}/d.jsonl', '--tokenizer={tok}',
                                            '--out={x}/out'], 'line 2', prepare=_jsonl(b))
           for b in bad]
  cases += [
      _c('jsonl rows', 'train', GPT + ['--data={x}/d.jsonl', '--out={x}/out'], 'line 2',
         prepare=_jsonl('{"prompt": "x"}')),   # byte-level .jsonl
      _c('jsonl rows', 'train', GPT + ['--data={x}/d.jsonl', '--tokenizer={tok}',
                                       '--out={x}/out'], 'holds no rows',
         prepare=_file('d.jsonl', b'\n\n')),
      _c('jsonl rows', 'train', GPT + ['--data={x}/rows', '--tokenizer={tok}', '--out={x}/out'],
         'b.jsonl line 1', prepare=_file('rows/b.jsonl', b'{"oops": 1}\n')),
      _c('jsonl rows', 'train', GPT + ['--data={x}/d.jsonl', '--tokenizer={tok}',
                                       '--out={x}/out'], 'too small',
         prepare=_file('d.jsonl', b'{"text": "hi"}\n')),
  ]
  return cases


def _tokenizer_cases() -> list[Case]:
  def t(argv_tok, needle, prepare=None, base=GPT):
    return _c('tokenizers', 'train', base + ['--data={jsonl}', f'--tokenizer={argv_tok}',
                                             '--out={x}/out'], needle, prepare=prepare)
  return [
      t('{x}/missing.json', 'no such file'), t('{x}', 'no such file'),
      t('{x}/t.json', 'not a tokenizer.json', _file('t.json', b'not json')),
      t('{x}/t.json', 'not a tokenizer.json', _file('t.json', b'{"not": "a tokenizer"}')),
      t('{x}/t.json', 'not a tokenizer.json', _file('t.json', b'')),
      t('{x}/t.json', 'not a tokenizer.json', _file('t.json', b'\xff\xfe\x00')),
      t('{x}', 'has no end-of-text token', _no_eot_tokenizer),
      _c('tokenizers', 'train', ['--model=llama', '--init-from={llama}', '--data={jsonl}',
                                 '--tokenizer={big}', '--steps=2', '--batch-size=2',
                                 '--seq-len=16', '--out={x}/out'], 'more than the 300 rows'),
      _c('tokenizers', 'train', ['--model=llama', '--init-from={llama}', '--data={jsonl}',
                                 '--tokenizer={x}/t.json', '--steps=2', '--seq-len=16',
                                 '--out={x}/out'],
         'not a tokenizer.json', prepare=_file('t.json', b'[]')),
  ]


def _hf_cases() -> list[Case]:
  def h(needle, prepare, more=()):
    return _c('hugging face folders', 'train', ['--model=llama', '--init-from={x}/hf',
                                                '--data={jsonl}', '--steps=2', '--out={x}/out',
                                                *more], needle, prepare=prepare)
  return [
      _c('hugging face folders', 'train', ['--init-from={x}/missing', '--out={x}/out'],
         'missing'),
      h('pytorch_model.bin (a pickle, never loaded here)', _torch_bin_only),
      h('config.json', _hf_config('not json')),
      h("rope_type 'yarn' is not supported", _hf_config(
          lambda c: {**c, 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0}})),
      h('', _hf_config(lambda c: {**c, 'hidden_act': 'relu6'})),
      h('', _hf_config(lambda c: {**c, 'model_type': 'bert'})),
      h('', _hf_config(lambda c: {**c, 'attention_bias': True})),
  ]


def _image_cases() -> list[Case]:
  def v(needle, prepare, more=()):
    return _c('image folders', 'train', VIT + ['--data={x}/img', '--out={x}/out', *more], needle,
              prepare=prepare)
  return [
      v('is not a folder', _file('img', b'x')),
      v('has no class folders', lambda x, p: (x / 'img').mkdir()),
      v('has no class folders', _file('img/readme.txt', b'x')),
      v('holds no images', _file('img/cat/notes.txt', b'x')),
      v("class folder 'empty' holds no images", _images({'': 3}, lambda i: (i / 'empty').mkdir())),
      v('has train/ but no val/', _images({'train': 2}, )),
      v('val/ has classes that train/ lacks', _images(then=lambda i: shutil.copytree(
          i / 'val' / 'red_disk', i / 'val' / 'green_star'))),
      v('has no readable training images', _images(then=_all_unreadable)),
      v('has no readable held-out images', _images(then=lambda i: [
          f.write_bytes(b'x') for f in (i / 'val').rglob('*.png')])),
      v('more than the limit of 89,478,485 pixels', _images(then=_huge_image)),
      v('holds no images', _file('img/cat/a.gif', b'GIF89a')),
      v("class folder 'empty' holds no images", _images(then=lambda i: (
          i / 'train' / 'empty').mkdir())),
      v('', _images(), ['--init-from={x}/missing']),
      v('--data-workers', _images(), ['--data-workers=-1']),
      v('--image-size must be >= 1', _images(), ['--image-size=0']),
  ]


def _cache_cases() -> list[Case]:
  """A resume with nothing to do of the tokenized run, over a damaged entry of its cache."""
  def d(damage, warnings=1):
    return _c('token cache damage', 'train', ['--out={tok_run}', '--resume'], 'damaged', code=0,
              prepare=lambda x, p: damage(_entry(p)), warnings=warnings)
  def same_size(e):
    ids = np.fromfile(e / 'train.tokens', np.uint32)
    ids[5] = (ids[5] + 1) % 300
    ids.tofile(e / 'train.tokens')
  cases = [
      d(lambda e: (e / 'meta.json').unlink()), d(lambda e: (e / 'meta.json').write_text('{')),
      d(lambda e: (e / 'meta.json').write_text('[]')),
      d(lambda e: (e / 'train.tokens').unlink()), d(lambda e: (e / 'val.mask').unlink()),
      d(lambda e: (e / 'train.offsets').write_bytes(b'')),
      d(lambda e: (e / 'train.tokens').write_bytes((e / 'train.tokens').read_bytes()[:-4])),
      d(same_size), d(lambda e: (e / 'val.tokens').write_bytes(
          b'\xff' * (e / 'val.tokens').stat().st_size)),
      d(lambda e: (e / 'train.mask').write_bytes(b'\x00' * (e / 'train.mask').stat().st_size)),
      d(lambda e: [f.unlink() for f in e.iterdir()] and None),
  ]
  cases += [
      _c('token cache damage', 'train', ['--out={tok_run}', '--resume'], code=0,
         prepare=lambda x, p: (p['cache'] / '.building-deadbeef-x' / 'sub').mkdir(parents=True)),
      _c('token cache damage', 'train', GPT + ['--data={jsonl}', '--tokenizer={tok}',
                                               '--out={x}/out'], 'token cache',
         prepare=lambda x, p: (x / 'file').write_text('x'), env={'REMAT_CACHE': '{x}/file'}),
  ]
  return cases


def _entry(paths: dict) -> Path:
  (entry,) = [e for e in paths['cache'].glob('tokens/*') if not e.name.startswith('.')]
  return entry


def _export_cases() -> list[Case]:
  def e(argv, needle, prepare=None):
    return _c('training.export', 'export', argv, needle, prepare=prepare)
  return [
      e(['{x}/missing', '{x}/hf'], 'no run folder'),
      e(['{x}/f', '{x}/hf'], 'no run folder', _file('f', b'x')),
      e(['{x}', '{x}/hf'], 'has no checkpoint'),
      e(['{x}/run', '{x}/hf'], 'has no checkpoint', _copy_run('bytes', _set_checkpoints_aside)),
      e(['{bytes}', '{x}/hf'], 'already exists', _file('hf/a', b'x')),
      e(['{bytes}', '{x}/f'], 'already exists', _file('f', b'x')),
      e(['{bytes}', '{x}/f/hf'], 'is a file', _file('f', b'x')),
      e(['{bytes}', '{x}/hf', '--dtype', 'float16'], 'invalid choice'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '1e400'], '--max-shard-size'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '0'], '--max-shard-size'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', 'abc'], '--max-shard-size'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '-1'], '--max-shard-size'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', 'nan'], '--max-shard-size'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '5XB'], 'is not a size like'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '5IB'], 'unknown unit IB'),
      e(['{bytes}', '{x}/hf', '--max-shard-size', '2PB'], '--max-shard-size'),
      e(['{x}/run', '{x}/hf'], 'no intact checkpoint', _copy_run('bytes', _damage_checkpoints)),
      e(['{bytes}'], 'required'), e([], 'required'), e(['{bytes}', '{x}/hf', '--colour'],
                                                        'unrecognized arguments'),
  ]


def _sample_cases() -> list[Case]:
  def s(argv, needle, prepare=None):
    return _c('training.sample', 'sample', argv, needle, prepare=prepare)
  run = ['{bytes}', '--prompt', 'def']
  return [
      s(['{x}/missing', '--prompt', 'a'], 'no run folder'), s(['{x}', '--prompt', 'a'],
                                                               'has no checkpoint'),
      s(['{vit}', '--prompt', 'a'], 'is a vit run'), s(['{bytes}'], '--prompt'),
      s(run + ['--max-new-tokens', '0'], '--max-new-tokens must be >= 1'),
      s(run + ['--max-new-tokens', '-1'], '--max-new-tokens must be >= 1'),
      s(run + ['--max-new-tokens', '1000000000'], "the model's context of 128 tokens"),
      s(run + ['--max-new-tokens', 'abc'], "'abc' is not an integer"),
      s(run + ['--temperature', '-1'], '--temperature must be'),
      s(run + ['--temperature', 'nan'], '--temperature must be'),
      s(run + ['--temperature', 'inf'], '--temperature must be'),
      s(run + ['--temperature', 'hot'], "'hot' is not a number"),
      s(run + ['--seed', '-1'], '--seed must be >= 0'),
      s(run + ['--seed', '4294967296'], '--seed must be <='),
      s(['{bytes}', '--prompt', ''], '--prompt is empty'),
      s(['{x}/run', '--prompt', 'a'], 'no intact checkpoint',
        _copy_run('bytes', _damage_checkpoints)),
      s(['{tok_run}', '--prompt', 'a', '--max-new-tokens', '500'], "context of 128 tokens"),
  ]


def cases() -> list[Case]:
  return (_train_flags() + _refusals() + _rows_cases() + _tokenizer_cases() + _hf_cases()
          + _image_cases() + _cache_cases() + _export_cases() + _sample_cases())


def test_the_probe_covers_150_inputs():
  counts = collections.Counter(c.area for c in cases())
  print(dict(counts), sum(counts.values()))
  assert sum(counts.values()) >= 150 and len(counts) == 9


# --- the workspace and the run of each case ---------------------------------------------------


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
  """Finished runs (byte-level, BPE-tokenized, ViT), data, tokenizers and a tiny HF Llama."""
  ws = tmp_path_factory.mktemp('ws')
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv('REMAT_CACHE', str(ws / 'cache'))   # the runs trained here; the cases get it too
    yield _workspace(ws)


def _workspace(ws: Path) -> dict:
  from text_fixtures import hf_llama
  from training.trainer import TrainConfig, train
  paths = {'ws': ws, 'cache': ws / 'cache', 'cwd': ws / 'cwd'}
  paths['cwd'].mkdir()
  corpus = ws / 'corpus.txt'
  corpus.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  data = ws / 'other.txt'
  data.write_text(corpus.read_text()[::-1])
  texts = [r['prompt'] + r['completion'] for r in rows(200)]
  paths.update(corpus=corpus, data=data, tok=bpe_tokenizer(ws / 'tok', texts),
               tok2=bpe_tokenizer(ws / 'tok2', texts[::-1], 280),
               big=bpe_tokenizer(ws / 'big', texts, 400),
               jsonl=write_jsonl(ws / 'd.jsonl', [{'text': t} for t in texts]))
  bpe_tokenizer(ws / 'llama', texts)
  paths['llama'] = hf_llama(ws / 'llama', vocab_size=300)
  small = dict(steps=4, batch_size=2, seq_len=16, warmup_steps=1, eval_every=4, eval_batches=1,
               save_every=2, memory_report=False)
  runs = {'bytes': dict(config='tiny', data=str(corpus)),
          'tok_run': dict(config='tiny', data=str(paths['jsonl']), tokenizer=str(paths['tok'])),
          'vit': dict(config='vit-tiny', steps=2, save_every=2, eval_every=2)}
  for name, kw in runs.items():
    cfg = TrainConfig(**{**small, 'out': str(ws / name), **kw})
    train(cfg, log=lambda *_: None, warn=pytest.fail)
    paths[name] = ws / name
  return paths


def _run_case(case: Case, paths: dict, x: Path) -> tuple[int, list[str], str]:
  fill = {k: str(v) for k, v in paths.items()} | {'x': str(x)}
  argv = [a.format(**fill) for a in case.argv]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT),
             REMAT_CACHE=str(paths['cache']))
  env.update({k: v.format(**fill) for k, v in case.env.items()})
  # Bytes, not text: text mode turns a progress bar's carriage returns into line ends.
  got = subprocess.run([sys.executable, *PROGS[case.prog], *argv], cwd=paths['cwd'], env=env,
                       capture_output=True, timeout=300)
  err = got.stderr.decode(errors='replace')
  lines = [l for l in visible(err) if not _plugin_notice(l)]
  return got.returncode, lines, err


@pytest.mark.slow
@pytest.mark.parametrize('area', ['train.py flags', 'refusals', 'jsonl rows', 'tokenizers',
                                  'hugging face folders', 'image folders', 'token cache damage',
                                  'training.export', 'training.sample'])
def test_each_bad_input_is_one_line_with_nothing_written(workspace, tmp_path, area):
  failures = []
  names = {'train': 'train.py', 'export': 'training.export', 'sample': 'training.sample'}
  for i, case in enumerate(c for c in cases() if c.area == area):
    x = tmp_path / str(i)
    x.mkdir()
    if case.prepare:
      case.prepare(x, workspace)
    watched = workspace['tok_run'] if case.code == 0 else workspace['ws']
    before = (folder_hash(watched), folder_hash(x))
    try:
      code, lines, err = _run_case(case, workspace, x)
    finally:
      while HELD:
        os.close(HELD.pop())
    want_lines = case.warnings if case.code == 0 else 1
    ok = (code == case.code and len(lines) == want_lines and 'Traceback' not in err
          and all(l.startswith(f'{names[case.prog]}: ') for l in lines)
          and (not case.needle or any(case.needle in l for l in lines))
          and (folder_hash(watched), folder_hash(x)) == before)
    if case.code == 0:   # the damaged entry was rebuilt and verifies
      from training.data import token_cache
      ok = ok and token_cache._problem(_entry(workspace), 300) is None
    if not ok:
      failures.append(f'{case.argv}: exit {code}, {lines or err[-2000:]}')
  assert not failures, '\n'.join(failures)
