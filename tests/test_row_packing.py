"""Rows packed whole into windows (training/data/row_packing.py, through load_tokens).

Checked on the batches themselves: every segment that holds a token the loss
counts is one whole row of the data, prompt included; padding is masked and
is exactly the share the packing reports; a row with a prompt that does not
fit a window is refused with a count; a long text row is cut into pieces that
give the row back in order.
"""

import numpy as np
import pytest

from text_fixtures import bpe_tokenizer, rows, write_jsonl
from training.data import DataError
from training.data.packed_text import load_tokens
from training.data.row_packing import pack
from training.data.tokenizer import load_tokenizer

SEQ = 48


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  folder = tmp_path_factory.mktemp('tok')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(100)])
  return load_tokenizer(folder)


def _row_ids(tok, r) -> tuple:
  return tuple(tok.encode(r['prompt'])) + tuple(tok.encode(r['completion'], special=False)) + (
      tok.eot_id,)


def _segments(b):
  """(tokens, loss mask) of every segment of every window of batch ``b``."""
  for i in range(len(b['tokens'])):
    for s in np.unique(b['segment_ids'][i]):
      at = b['segment_ids'][i] == s
      yield tuple(b['tokens'][i][at].tolist()), b['loss_mask'][i][at]


def test_no_window_holds_a_completion_without_its_prompt(tok, tmp_path):
  items = rows(300)
  data = write_jsonl(tmp_path / 'd.jsonl', items)
  got = load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  whole = {_row_ids(tok, r) for r in items}
  batches = [got.batch(step, 8, SEQ, seed=0) for step in range(20)]
  batches += got.val_batches(1, len(got.val_windows), SEQ)
  counted = 0
  for b in batches:
    for ids, mask in _segments(b):
      if mask.any():   # a segment the loss counts is a whole row: its prompt is in the window
        assert ids in whole, ids
        counted += 1
      else:            # the rest is padding: masked, after the window's rows
        assert set(ids) == {got.pad_id}
  assert counted > 160   # 20 batches of 8 windows of ~2 rows, and the 30 held-out rows


def test_padding_is_masked_and_the_fraction_is_what_the_windows_hold(tok, tmp_path):
  data = write_jsonl(tmp_path / 'd.jsonl', rows(200))
  got = load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  w = got.train_windows
  every = w.windows(got.train.tokens, got.train.mask, np.arange(len(w)))
  segs = every['segment_ids']
  last_row = segs.max(axis=1, keepdims=True)
  # A window's last segment is padding when the rows leave room: masked, never counted.
  padding = (segs == last_row) & (every['loss_mask'] == 0) & (every['tokens'] == got.pad_id)
  rows_tokens = every['tokens'].size - padding.sum()
  assert rows_tokens == len(got.train)   # every training token is in exactly one window
  assert w.fraction == pytest.approx(len(got.train) / every['tokens'].size, abs=0)
  assert 0.5 < w.fraction < 1.0   # rows of ~20 tokens in windows of 49: some padding
  line = got.packing_line
  assert f'{w.fraction:.1%} of train window tokens are rows' in line and 'padding (masked)' in line


def test_held_out_windows_hold_every_held_out_row_once(tok, tmp_path):
  items = rows(100)
  data = write_jsonl(tmp_path / 'd.jsonl', items)
  got = load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  (b,) = got.val_batches(1, len(got.val_windows), SEQ)
  seen = sorted(ids for ids, mask in _segments(b) if mask.any())
  assert seen == sorted(_row_ids(tok, r) for r in items[9::10])


def test_a_row_with_a_prompt_longer_than_a_window_is_refused_with_a_count(tok, tmp_path):
  items = rows(30)
  items[3] = {'prompt': 'question ' * 30, 'completion': ' red.'}
  items[19] = {'prompt': 'question ' * 40, 'completion': ' red.'}   # held out: counted too
  data = write_jsonl(tmp_path / 'd.jsonl', items)
  longest = len(_row_ids(tok, items[19]))
  with pytest.raises(DataError) as e:
    load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  line = str(e.value)
  assert f'2 of 30 rows with a prompt are longer than a window of --seq-len {SEQ}' in line
  assert f'the longest has {longest}' in line and f'--seq-len {longest - 1} or more' in line
  assert '\n' not in line and list((tmp_path / 'c').iterdir()) == []   # nothing cached
  got = load_tokens(str(data), tok, longest - 1, cache=tmp_path / 'c')   # and it fits
  assert len(got.val_windows) > 0


def test_a_long_text_row_is_cut_into_pieces_in_order(tok, tmp_path):
  text = ' '.join(f'which colour is the cat {i}?' for i in range(40))
  data = write_jsonl(tmp_path / 'd.jsonl', [{'text': text}] * 10 + [{'text': 'the fox.'}])
  got = load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  ids = tuple(tok.encode(text)) + (tok.eot_id,)
  assert len(ids) > 3 * (SEQ + 1)
  w = got.train_windows
  every = w.windows(got.train.tokens, got.train.mask, np.arange(len(w)))
  pieces = [(start, ids_) for start, ids_ in zip(w.piece_start.tolist(), w.piece_len.tolist())]
  first = sorted(p for p in pieces if p[0] < len(ids))   # the first row's pieces, in stream order
  rebuilt = sum((tuple(got.train.tokens[s:s + n].tolist()) for s, n in first), ())
  assert rebuilt == ids and all(n <= SEQ + 1 for _, n in first)
  assert (every['positions'][every['segment_ids'] == 0][:1] == 0).all()


def test_next_fit_packing_on_lengths():
  starts = np.array([0, 5, 9, 19, 20])
  lengths = np.array([5, 4, 10, 1, 6])
  got = pack(starts, lengths, np.array([True, True, True, False, False]), capacity=10)
  # [5, 4] fill 9 of 10; 10 does not fit with them; then 1 and 6 share the third window.
  np.testing.assert_array_equal(got.window_first, [0, 2, 3, 5])
  np.testing.assert_array_equal(got.piece_offset, [0, 5, 0, 0, 1])
  assert got.fraction == pytest.approx(26 / 30)
  b = got.windows(np.arange(30), np.ones(30, np.uint8), np.array([0, 2]), pad_id=-1)
  np.testing.assert_array_equal(b['segment_ids'][0], [0] * 5 + [1] * 4 + [2])
  np.testing.assert_array_equal(b['positions'][0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(b['tokens'][1], [19, 20, 21, 22, 23, 24, 25, -1, -1, -1])
  np.testing.assert_array_equal(b['loss_mask'][1], [1] * 7 + [0] * 3)
  with pytest.raises(ValueError, match='longer than a window'):
    pack(starts, lengths, np.ones(5, bool), capacity=9)


def test_fewer_than_ten_rows_are_not_cut_inside_a_prompt_row(tok, tmp_path):
  items = rows(5)
  data = write_jsonl(tmp_path / 'd.jsonl', items)
  got = load_tokens(str(data), tok, SEQ, cache=tmp_path / 'c')
  (b,) = got.val_batches(1, len(got.val_windows), SEQ)
  held = [ids for ids, mask in _segments(b) if mask.any()]
  assert held and all(ids in {_row_ids(tok, r) for r in items} for ids in held)
