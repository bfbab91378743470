"""Tokenizers and the token cache (training/data/tokenizer.py, training/data/packed_text.py)."""

import json

import numpy as np
import pytest

from text_fixtures import EOT, bpe_tokenizer, rows, write_jsonl
from training.data import DataError
from training.data.packed_text import cache_root, load_tokens
from training.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  folder = tmp_path_factory.mktemp('tok')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(100)])
  return load_tokenizer(folder)   # a folder holding tokenizer.json


def test_tokenizer_reads_the_end_of_text_token(tok, tmp_path):
  assert tok.eot_token == EOT and tok.vocab_size == 300
  assert tok.decode(tok.encode('which colour is the cat?')) == 'which colour is the cat?'
  assert isinstance(load_tokenizer(None), ByteTokenizer)
  with pytest.raises(TokenizerError, match='no such file'):
    load_tokenizer(tmp_path / 'missing')
  (tmp_path / 'bad.json').write_text('{"not": "a tokenizer"}')
  with pytest.raises(TokenizerError, match='not a tokenizer.json'):
    load_tokenizer(tmp_path / 'bad.json')


def test_prompt_is_masked_and_documents_end_with_eot(tok, tmp_path):
  items = rows(30)
  data = write_jsonl(tmp_path / 'd.jsonl', items)
  got = load_tokens(str(data), tok, 32, cache=tmp_path / 'cache')
  assert got.num_documents == 30 and not got.cached
  # Document 0 is the first training document (every 10th, from the 10th, is held out).
  first = items[0]
  head = tok.encode(first['prompt'])
  tail = tok.encode(first['completion'], special=False)
  n = len(head) + len(tail) + 1
  np.testing.assert_array_equal(got.train.tokens[:n], np.concatenate([head, tail, [tok.eot_id]]))
  np.testing.assert_array_equal(got.train.mask[:n], [0] * len(head) + [1] * (n - len(head)))
  assert got.train.starts[1] == n
  assert len(got.val) == sum(len(tok.encode(r['prompt'])) + len(tok.encode(
      r['completion'], special=False)) + 1 for r in items[9::10])


def test_second_load_reads_the_cache(tok, tmp_path):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(12))
  first = load_tokens(str(data), tok, 32, cache=tmp_path / 'c')
  second = load_tokens(str(data), tok, 32, cache=tmp_path / 'c')
  assert (first.cached, second.cached) == (False, True)
  assert isinstance(second.train.tokens, np.memmap)
  np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
  write_jsonl(data, rows(13))   # other data: another cache entry
  assert not load_tokens(str(data), tok, 32, cache=tmp_path / 'c').cached
  assert len(list((tmp_path / 'c').iterdir())) == 2


def test_windows_are_packed_with_segments_and_restarting_positions(tok, tmp_path):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(40))
  got = load_tokens(str(data), tok, 32, cache=tmp_path / 'c')
  b = got.batch(step=3, batch_size=4, seq_len=32, seed=7)
  assert all(v.shape == (4, 33) and v.dtype == np.int32 for v in b.values())
  for k, v in got.batch(3, 4, 32, 7).items():   # a pure function of (seed, step)
    np.testing.assert_array_equal(v, b[k])
  assert not np.array_equal(got.batch(4, 4, 32, 7)['tokens'], b['tokens'])
  segs, pos = b['segment_ids'], b['positions']
  assert (segs[:, 0] == 0).all() and (pos[:, 0] == 0).all()
  new_doc = np.diff(segs, axis=1) != 0
  assert new_doc.any()   # windows of 33 tokens hold rows of ~20 and padding
  np.testing.assert_array_equal(pos[:, 1:], np.where(new_doc, 0, pos[:, :-1] + 1))
  # A row ends with an end-of-text token, so a new segment starts right after one.
  assert (b['tokens'][:, :-1][new_doc] == tok.eot_id).all()
  # A process's share on a mesh: its rows of the same global batch, the rest left zero.
  share = got.batch(3, 4, 32, 7, rows=(1, 3))
  for k, v in share.items():
    np.testing.assert_array_equal(v[[1, 3]], b[k][[1, 3]])
    assert not v[[0, 2]].any(), k


@pytest.mark.parametrize('line,why', [('{"prompt": "x"}', 'keys prompt'),
                                      ('[1, 2]', 'a JSON list'), ('{"text": ', 'not JSON')])
def test_bad_row_is_one_line_and_leaves_no_cache(tok, tmp_path, line, why):
  data = tmp_path / 'd.jsonl'
  data.write_text(json.dumps({'text': 'fine'}) + '\n' + line + '\n')
  with pytest.raises(DataError) as e:
    load_tokens(str(data), tok, 8, cache=tmp_path / 'c')
  assert 'line 2' in str(e.value) and why in str(e.value) and '\n' not in str(e.value)
  assert list((tmp_path / 'c').iterdir()) == []   # the half-built cache was removed


def test_text_files_with_a_tokenizer_and_bytes_with_jsonl(tok, tmp_path):
  (tmp_path / 'docs').mkdir()
  for i in range(3):
    (tmp_path / 'docs' / f'{i}.txt').write_text(f'which colour is the cat {i}? ' * 20)
  got = load_tokens(str(tmp_path / 'docs'), tok, 16, cache=tmp_path / 'c')
  assert got.num_documents == 3 and int(got.train.tokens[got.train.starts[1] - 1]) == tok.eot_id
  # Byte-level jsonl: no end-of-text token; the documents are told apart by segments alone.
  data = write_jsonl(tmp_path / 'd.jsonl', [{'text': 'a' * 20},
                                            {'prompt': 'b' * 10, 'completion': 'c' * 10}])
  got = load_tokens(str(data), ByteTokenizer(), 24, cache=tmp_path / 'c')
  both = lambda f: np.concatenate([f(got.train), f(got.val)])
  assert bytes(both(lambda s: s.tokens).astype(np.uint8)) == b'a' * 20 + b'b' * 10 + b'c' * 10
  np.testing.assert_array_equal(both(lambda s: s.mask), [1] * 20 + [0] * 10 + [1] * 10)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path))
  assert cache_root() == tmp_path / 'tokens'
