"""Chat rows (training/data/chat.py): rendered as transformers renders them, trained on the
assistant turns only (checked on the batches), and learned.

The tokenizer is a BPE trained here with ChatML's special tokens and a ChatML
``chat_template`` in its ``tokenizer_config.json``; a row is a system line, a
question naming an animal and the assistant's answer, its colour (two turns
in every third row).
"""

import json
import random

import numpy as np
import pytest

from text_fixtures import COLOURS, hf_llama, write_jsonl
from training import cli
from training.data import DataError
from training.data.packed_text import load_tokens
from training.data.tokenizer import load_tokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chats(n: int, seed: int = 0) -> list[dict]:
  rng = random.Random(seed)
  out = []
  for i in range(n):
    animal = rng.choice(sorted(COLOURS))
    turns = [{'role': 'system', 'content': 'Answer with a colour.'},
             {'role': 'user', 'content': f'question {rng.randint(0, 999)}: the {animal}?'},
             {'role': 'assistant', 'content': f'{COLOURS[animal]} {COLOURS[animal]}.'}]
    if i % 3 == 0:
      other = rng.choice(sorted(COLOURS))
      turns += [{'role': 'user', 'content': f'and the {other}?'},
                {'role': 'assistant', 'content': f'{COLOURS[other]}.'}]
    out.append({'messages': turns})
  return out


def chat_tokenizer(folder, texts):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / 'tokenizer.json'))
  (folder / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': '<|endoftext|>', 'chat_template': CHATML}))
  return folder


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp('chat')
  texts = [m['content'] for r in chats(200) for m in r['messages']]
  return chat_tokenizer(folder, texts)


def test_only_assistant_turns_are_trained_on_the_batches(folder, tmp_path):
  import transformers
  items = chats(60)
  data = write_jsonl(tmp_path / 'chat.jsonl', items)
  tok = load_tokenizer(folder)
  got = load_tokens(str(data), tok, 96, cache=tmp_path / 'c')
  # The row as transformers renders it, whole: what the windows hold, piece by piece.
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / 'tokenizer.json'),
                                            chat_template=CHATML)
  rendered = {hf.apply_chat_template(r['messages'], tokenize=False) for r in items}
  answers = {r['messages'][k]['content'] for r in items for k in (2, 4) if k < len(r['messages'])}
  seen = 0
  for step in range(10):
    b = got.batch(step, 8, 96, seed=0)
    for i in range(8):
      for s in np.unique(b['segment_ids'][i]):
        at = b['segment_ids'][i] == s
        mask = b['loss_mask'][i][at].astype(bool)
        if not mask.any():
          continue   # padding
        ids = b['tokens'][i][at]
        assert tok.decode(ids) in rendered
        # The trained runs are the assistant answers, each with its end marker.
        runs = np.split(ids, np.flatnonzero(np.diff(mask.astype(int))) + 1)
        flags = np.split(mask, np.flatnonzero(np.diff(mask.astype(int))) + 1)
        trained = [tok.decode(r) for r, f in zip(runs, flags) if f[0]]
        assert trained and all(t.endswith('<|im_end|>\n') for t in trained), trained
        assert {t[:-len('<|im_end|>\n')] for t in trained} <= answers
        assert not any('user' in t or 'system' in t for t in trained)
        seen += 1
  assert seen > 20


def test_chat_rows_without_a_template_or_an_answer_are_one_line(folder, tmp_path):
  tok = load_tokenizer(folder)
  data = write_jsonl(tmp_path / 'q.jsonl', [{'messages': [{'role': 'user', 'content': 'hi'}]}])
  with pytest.raises(DataError, match='line 1: a chat row needs an assistant turn'):
    load_tokens(str(data), tok, 32, cache=tmp_path / 'c')
  bad = write_jsonl(tmp_path / 'b.jsonl', [{'messages': [{'role': 'user'}]}])
  with pytest.raises(DataError, match='message 1 needs a string "role" and a string "content"'):
    load_tokens(str(bad), tok, 32, cache=tmp_path / 'c')
  plain = tmp_path / 'plain'
  plain.mkdir()
  (plain / 'tokenizer.json').write_bytes((folder / 'tokenizer.json').read_bytes())
  with pytest.raises(DataError, match="needs the tokenizer's chat template"):
    load_tokens(str(write_jsonl(tmp_path / 'c.jsonl', chats(3))), load_tokenizer(plain), 32,
                cache=tmp_path / 'c')
  assert list((tmp_path / 'c').iterdir()) == []


@pytest.mark.slow
def test_a_chat_run_learns_the_answers(folder, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  hf_llama(folder, vocab_size=300, max_position_embeddings=128)
  data = write_jsonl(tmp_path / 'chat.jsonl', chats(400))
  run = tmp_path / 'run'
  assert cli.main(['--model', 'llama', '--init-from', str(folder), '--data', str(data),
                   '--steps', '60', '--batch-size', '16', '--seq-len', '96', '--lr', '1e-2',
                   '--warmup-steps', '10', '--eval-every', '20', '--out', str(run),
                   '--no-memory-report']) == 0, capsys.readouterr().err
  rows = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
  val = [r['val_loss'] for r in rows if 'val_loss' in r]
  print(f"train loss {rows[0]['loss']} -> {rows[-1]['loss']}, val loss by 20 steps {val}")
  # A random model scores ln 300 = 5.7 nats per token; the answers are a function of the
  # question, so the loss on them falls far below that.
  assert val[-1] < 0.25 * rows[0]['loss'], (rows[0]['loss'], val)
