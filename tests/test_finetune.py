"""Fine-tuning a Hugging Face Llama on prompt/completion rows, end to end, and the bad inputs on the way.

The end-to-end case: a random-weight ``LlamaForCausalLM`` (save_pretrained,
with a BPE tokenizer trained here) is fine-tuned by ``train.py`` on a .jsonl
of prompt/completion rows, exported by ``training.export`` and scored by
``transformers`` on held-out rows: the completion's loss falls far below the
initial model's, the prompt's (masked out of the loss) does not.
"""

import json
import shutil

import numpy as np
import pytest

from text_fixtures import bpe_tokenizer, hf_llama, rows, write_jsonl
from training import cli
from training import export as export_cli
from training.data.tokenizer import load_tokenizer


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A tiny HF Llama folder holding its BPE tokenizer (300 ids)."""
  folder = tmp_path_factory.mktemp('llama')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(200)])
  return hf_llama(folder, vocab_size=300)


def _losses(model, tok, items):
  """Mean per-token loss of the prompt's tokens and of the completion's (with end-of-text)."""
  import torch
  prompt, completion = [], []
  for r in items:
    head = list(tok.encode(r['prompt']))
    ids = head + list(tok.encode(r['completion'], special=False)) + [tok.eot_id]
    with torch.no_grad():
      logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    ce = -logp[np.arange(len(ids) - 1), ids[1:]]   # ce[t]: the loss of token t + 1
    prompt += list(ce[:len(head) - 1])
    completion += list(ce[len(head) - 1:])
  return float(np.mean(prompt)), float(np.mean(completion))


def json_rows(path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _train(args, capsys):
  code = cli.main(args)
  return code, capsys.readouterr().err


def _one_error(err: str, prog: str) -> bool:
  """One error line and no traceback (the tokenizing bar, cleared, may precede it)."""
  lines = [l for l in err.replace('\r', '\n').split('\n') if l.strip()]
  return ('Traceback' not in err and len([l for l in lines if l.startswith(prog)]) == 1
          and lines[-1].startswith(f'{prog}: error: '))


@pytest.mark.slow
def test_finetune_learns_the_completion_not_the_prompt(checkpoint, tmp_path, monkeypatch, capsys):
  import transformers
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  data = write_jsonl(tmp_path / 'train.jsonl', rows(400))
  run, out = tmp_path / 'run', tmp_path / 'export'
  code, err = _train(['--model', 'llama', '--init-from', str(checkpoint), '--data', str(data),
                      '--steps', '80', '--batch-size', '16', '--seq-len', '64', '--lr', '1e-2',
                      '--warmup-steps', '10', '--eval-every', '40', '--eval-batches', '1',
                      '--out', str(run), '--no-memory-report'], capsys)
  assert code == 0, err
  assert export_cli.main([str(run), str(out)]) == 0
  tok = load_tokenizer(out)
  # The reported held-out loss is the mean over the completion tokens of the held-out rows
  # (every 10th row of the file; one batch of 16 windows holds all 40 of them, packed whole).
  model = transformers.LlamaForCausalLM.from_pretrained(out)
  reported = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()][-1]
  per_row = _losses(model, tok, json_rows(data)[9::10])[1]
  print(f'reported val loss {reported["val_loss"]}, per-row completion loss {per_row}')
  # The same tokens scored by the same weights: only float32 summation order differs (1e-5
  # relative); 10% is the bound of issue 35, whose run reported 0.244 against 0.0002 per row
  # when windows cut rows.
  assert abs(reported['val_loss'] - per_row) < 0.1 * per_row, (reported, per_row)
  held_out = rows(40, seed=1)
  before = _losses(transformers.LlamaForCausalLM.from_pretrained(checkpoint), tok, held_out)
  _, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys']
  after = _losses(model, tok, held_out)
  print(f'prompt, completion loss (nats/token): initial {before}, fine-tuned {after}')
  (prompt0, completion0), (prompt1, completion1) = before, after
  # A random model scores every token near ln(300) = 5.7 nats; the completion (its colour is a
  # function of the prompt's animal) is learned to a small fraction of that.
  assert completion1 < 0.25 * completion0, (before, after)
  # The prompt's tokens never counted in the loss, and no prompt word is in a completion:
  # their loss does not fall as the completion's did (measured: it rose, 5.70 -> 10.7 nats,
  # while the completion's fell 5.70 -> 0.017; the model learned those words are never targets).
  assert prompt0 - prompt1 < 0.25 * (completion0 - completion1), (before, after)


def test_bad_input_is_one_line_and_writes_nothing(checkpoint, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  base = ['--model', 'llama', '--init-from', str(checkpoint), '--steps', '2', '--batch-size', '2',
          '--seq-len', '16', '--no-memory-report']
  good = write_jsonl(tmp_path / 'good.jsonl', rows(20))
  # A tokenizer with more ids than the checkpoint's embedding.
  big = bpe_tokenizer(tmp_path / 'big', [r['prompt'] + r['completion'] for r in rows(200)], 400)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text(json.dumps({'text': 'fine'}) + '\n' + json.dumps({'question': 'x'}) + '\n')
  rope = tmp_path / 'rope'
  shutil.copytree(checkpoint, rope)
  cfg = json.loads((rope / 'config.json').read_text())
  cfg['rope_scaling'] = {'rope_type': 'yarn', 'factor': 2.0}
  (rope / 'config.json').write_text(json.dumps(cfg))
  cases = [(['--data', str(good), '--tokenizer', str(big)], 'more than the 300 rows'),
           (['--data', str(bad)], 'line 2: a row needs a string "text"'),
           (['--data', str(good), '--init-from', str(rope)], "rope_type 'yarn' is not supported")]
  for i, (extra, message) in enumerate(cases):
    out = tmp_path / f'out{i}'
    code, err = _train(base + extra + ['--out', str(out)], capsys)
    assert code == 2 and message in err and _one_error(err, 'train.py'), err
    assert not out.exists()
  # Exporting a run folder with no checkpoint, and a folder that is no run.
  (tmp_path / 'empty_run').mkdir()
  for run in (tmp_path / 'empty_run', tmp_path / 'missing'):
    assert export_cli.main([str(run), str(tmp_path / 'x')]) == 2
    err = capsys.readouterr().err
    assert _one_error(err, 'training.export'), err
    assert not (tmp_path / 'x').exists()
