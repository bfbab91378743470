"""The learning rate in metrics.jsonl: each row has the rate its step's update used (the
optimizer's schedule, training/step/train_step.py: make_optimizer builds AdamW on lr_schedule)."""

import json

import pytest

from training.step.train_step import lr_schedule
from training.trainer import TrainConfig, train


def test_each_row_has_the_rate_of_its_update(tmp_path):
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(''.join(f'def f{i}(x):\n    return x * {i}\n' for i in range(200)))
  cfg = TrainConfig(config='tiny', remat='none', steps=6, batch_size=2, seq_len=16, lr=1e-2,
                    warmup_steps=2, eval_every=6, eval_batches=1, memory_report=False,
                    out=str(tmp_path / 'run'), data=str(corpus))
  train(cfg, log=lambda *_: None, warn=pytest.fail)
  rows = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  schedule = lr_schedule(1e-2, 6, 2)
  assert [r['lr'] for r in rows] == [float(f'{float(schedule(s)):.6g}') for s in range(6)]
  assert rows[0]['lr'] == 0.0 and rows[2]['lr'] == 1e-2   # warmup from 0, then the peak

