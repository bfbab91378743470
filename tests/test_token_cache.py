"""The token cache under concurrency and damage (training/data/token_cache.py, issue 36 (2), (3)).

Three runs building the same entry at once all succeed with one entry; a
damaged or partial entry is rebuilt with one warning; an edit of the data that
keeps its size and modification time gets a new entry; a killed build leaves
no ``.building-*`` folder for long; errors name the cache path.
"""

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from text_fixtures import bpe_tokenizer, rows, write_jsonl
from training.data import DataError, token_cache
from training.data.packed_text import load_tokens
from training.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  folder = tmp_path_factory.mktemp('tok')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(100)])
  return load_tokenizer(folder)


def _entries(cache: Path) -> list[str]:
  return sorted(p.name for p in cache.iterdir())


def _load(data, tok, cache, warned=None):
  return load_tokens(str(data), tok, 32, cache=cache,
                     warn=(warned.append if warned is not None else pytest.fail))


# Each process waits at the rename until all three have built their entry, so every one of
# them races for the same name (before, two crashed with `OSError: Directory not empty`).
RACER = '''
import os, sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
from training.data.packed_text import load_tokens
from training.data.tokenizer import load_tokenizer
barrier, real = Path({barrier!r}), os.rename
def rename(src, dst):
  if '.building-' in str(src):
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < 3:
      time.sleep(0.01)
  real(src, dst)
os.rename = rename
got = load_tokens({data!r}, load_tokenizer({tok!r}), 32, cache=Path({cache!r}))
print(got.cached, int(got.train.tokens.sum()))
'''


def test_three_concurrent_builds_all_succeed_with_one_entry(tok, tmp_path):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(40))
  cache, barrier = tmp_path / 'cache', tmp_path / 'barrier'
  barrier.mkdir()
  script = RACER.format(root=str(ROOT), tests=str(ROOT / 'tests'), barrier=str(barrier),
                        data=str(data), tok=str(tok.path), cache=str(cache))
  procs = [subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(3)]
  results = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, results):
    assert p.returncode == 0 and 'Traceback' not in err, err
  sums = {out.split()[1] for out, _ in results}
  assert len(sums) == 1   # every run reads the same tokens
  assert len(_entries(cache)) == 1 and not _entries(cache)[0].startswith('.')
  assert _load(data, tok, cache).cached   # the winner's entry verifies


def _damage_meta(entry: Path):
  (entry / 'meta.json').unlink()   # a partial entry (an older build killed before its meta)


def _truncate(entry: Path):
  f = entry / 'train.tokens'
  f.write_bytes(f.read_bytes()[:-4])


def _same_size_tokens(entry: Path):
  f = entry / 'train.tokens'
  ids = np.fromfile(f, np.uint32)
  ids[3] = (ids[3] + 1) % 300   # another valid id, same size: trained silently before
  ids.tofile(f)


def _beyond_vocab(entry: Path):
  f = entry / 'train.tokens'
  ids = np.fromfile(f, np.uint32)
  ids[0] = 10**6   # reported as divergence before
  ids.tofile(f)


def _remove_mask(entry: Path):
  (entry / 'val.mask').unlink()


@pytest.mark.parametrize('damage,reason', [
    (_damage_meta, 'no meta.json'), (_truncate, 'train.tokens has'),
    (_same_size_tokens, 'train.tokens does not match its SHA-256'),
    (_beyond_vocab, 'train.tokens does not match'), (_remove_mask, 'val.mask is missing')])
def test_a_damaged_entry_is_rebuilt_with_one_line(tok, tmp_path, damage, reason):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(30))
  cache = tmp_path / 'cache'
  first = _load(data, tok, cache)
  good = np.array(first.train.tokens)
  (entry,) = [cache / n for n in _entries(cache)]
  damage(entry)
  warned = []
  again = _load(data, tok, cache, warned)
  assert not again.cached and len(warned) == 1, warned
  assert f'token cache entry {entry} is damaged ({reason}' in warned[0], warned
  np.testing.assert_array_equal(again.train.tokens, good)
  assert _load(data, tok, cache).cached and _entries(cache) == [entry.name]


def test_token_ids_are_checked_against_the_vocabulary(tok, tmp_path):
  """A consistent entry (digests rewritten) whose ids the tokenizer cannot make is rebuilt."""
  data = write_jsonl(tmp_path / 'd.jsonl', rows(30))
  cache = tmp_path / 'cache'
  _load(data, tok, cache)
  (entry,) = [cache / n for n in _entries(cache)]
  _beyond_vocab(entry)
  meta = json.loads((entry / 'meta.json').read_text())
  meta['files']['train.tokens']['sha256'] = token_cache._sha256(entry / 'train.tokens')
  (entry / 'meta.json').write_text(json.dumps(meta))
  warned = []
  _load(data, tok, cache, warned)
  assert len(warned) == 1 and 'holds token id 1000000, beyond the vocabulary of 300' in warned[0]


def test_an_edit_of_the_same_size_and_time_is_a_new_entry(tok, tmp_path):
  data = tmp_path / 'd.jsonl'
  write_jsonl(data, [{'text': 'the cat is red. ' * 20}] * 12)
  cache = tmp_path / 'cache'
  before = _load(data, tok, cache)
  st = data.stat()
  data.write_text(data.read_text().replace('cat', 'dog', 1))   # same size
  os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))           # and the same mtime
  assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
  after = _load(data, tok, cache)
  assert not after.cached and len(_entries(cache)) == 2
  assert not np.array_equal(np.array(before.train.tokens), np.array(after.train.tokens))
  # The same bytes under another name are the same entry.
  moved = tmp_path / 'moved.jsonl'
  moved.write_bytes(data.read_bytes())
  assert _load(moved, tok, cache).cached and len(_entries(cache)) == 2


def test_a_killed_build_leaves_nothing_behind(tok, tmp_path):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(20))
  cache = tmp_path / 'cache'
  cache.mkdir()
  dead = cache / '.building-0123456789ab-killed'   # what a kill -9 mid-build left
  (dead / 'sub').mkdir(parents=True)
  (dead / 'train.tokens').write_bytes(b'\0' * 40)
  live = cache / '.building-0123456789ab-running'  # another run building right now
  live.mkdir()
  fd = os.open(live, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX)
  try:
    _load(data, tok, cache)
    assert not dead.exists() and live.exists()
  finally:
    os.close(fd)
  _load(data, tok, cache)
  assert [n for n in _entries(cache) if n.startswith('.')] == []


def test_a_bad_row_leaves_no_entry_and_no_building_folder(tok, tmp_path):
  data = tmp_path / 'd.jsonl'
  data.write_text(json.dumps({'text': 'fine'}) + '\n{"oops": 1}\n')
  with pytest.raises(DataError, match='line 2'):
    _load(data, tok, tmp_path / 'cache')
  assert _entries(tmp_path / 'cache') == []


def test_data_a_run_cannot_use_leaves_no_entry(tok, tmp_path):
  """Refused after tokenizing (too small for --seq-len, or a check of the caller's): the entry is
  checked before it is renamed into place, so a refused run writes nothing to the cache."""
  data = write_jsonl(tmp_path / 'd.jsonl', [{'text': 'hi'}])
  with pytest.raises(DataError, match='is too small'):
    _load(data, tok, tmp_path / 'cache')

  def refuse(train, val):
    raise DataError(f'{val} held-out windows are not enough')
  data = write_jsonl(tmp_path / 'e.jsonl', rows(30))
  with pytest.raises(DataError, match='held-out windows are not enough'):
    load_tokens(str(data), tok, 32, cache=tmp_path / 'cache', warn=pytest.fail, check=refuse)
  assert _entries(tmp_path / 'cache') == []


def test_cache_errors_are_one_line_naming_the_cache(tok, tmp_path, monkeypatch):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(20))
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  with pytest.raises(DataError) as e:
    _load(data, tok, a_file / 'tokens')
  assert f"token cache '{a_file / 'tokens'}'" in str(e.value) and '\n' not in str(e.value)

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device', str(tmp_path / 'cache' / 'x'))
  monkeypatch.setattr(token_cache, '_write_durably', full)
  with pytest.raises(DataError) as e:
    _load(data, tok, tmp_path / 'cache')
  assert str(e.value).startswith('no space left on device writing the token cache')
  assert '$REMAT_CACHE' in str(e.value)
  assert _entries(tmp_path / 'cache') == []   # the partial folder was removed
