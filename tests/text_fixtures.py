"""Data for the text tests, made in the test: a BPE tokenizer, prompt/completion rows, a tiny HF Llama.

The task: the prompt names an animal, and the completion is that animal's
colour (a fixed map), so a model can learn the completion from the prompt.
Prompt words (``question``, ``which``, ``colour``, digits) never occur in a
completion, so a model trained on completions alone has nothing to learn
about them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {'cat': 'red', 'dog': 'blue', 'fox': 'green', 'owl': 'yellow', 'bee': 'black',
           'cow': 'white', 'pig': 'pink', 'hen': 'brown'}
EOT = '<|endoftext|>'


def rows(n: int, seed: int = 0) -> list[dict]:
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    animal = rng.choice(sorted(COLOURS))
    out.append({'prompt': f'question {rng.randint(0, 999)}: which colour is the {animal}?',
                'completion': f' {COLOURS[animal]} {COLOURS[animal]}.'})
  return out


def write_jsonl(path: Path, items: list[dict]) -> Path:
  path.write_text(''.join(json.dumps(r) + '\n' for r in items))
  return path


def bpe_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300) -> Path:
  """Trains a byte-level BPE ``tokenizer.json`` (with ``<|endoftext|>``) into ``folder``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / 'tokenizer.json'))
  return folder / 'tokenizer.json'


def hf_llama(folder: Path, vocab_size: int, seed: int = 0, **overrides) -> Path:
  """A random-weight ``LlamaForCausalLM`` saved with ``save_pretrained`` (tiny: width 32, 2 layers)."""
  import torch
  import transformers
  fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
  fields.update(overrides)
  torch.manual_seed(seed)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).save_pretrained(folder)
  return folder
