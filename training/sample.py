"""``python -m training.sample RUN_DIR --prompt TEXT`` (or ``--prompts FILE``): a text run's
continuation of a prompt.

Loads the run's latest checkpoint and the tokenizer it trained with (its saved
copy; bytes for a byte-level run), then generates one token at a time: greedy
(the most likely token) at ``--temperature 0``, else sampled from the softmax
of the logits divided by the temperature (seeded by ``--seed``). It stops
after ``--max-new-tokens`` or at the tokenizer's end-of-text token, and
prints the continuation alone.

Greedy generation keeps a KV cache (:func:`models.kv_decode.greedy_generate`) and
stops at the model's context. Sampling reruns the model over a fixed window
for every token (the prompt and the tokens so far, right-padded to one length,
so the step is compiled once; a causal model's logit at a position does not
see the padding after it); beyond the model's ``max_len`` the window keeps the
latest ``max_len`` tokens.

``--prompts FILE`` continues every prompt of a file (one per line of a text
file, or the ``"prompt"`` of each row of a ``.jsonl`` file), greedy ones in
batches of :data:`PROMPT_BATCH`, and prints one JSON line per prompt:
``{"prompt": ..., "completion": ...}``.
"""

from __future__ import annotations

import sys

import numpy as np

from training.arguments import OneLineParser


PROMPT_BATCH = 64   # prompts generated together (one KV cache of this many rows)


class SampleError(ValueError):
  """Unusable sampling settings or run; the message is one line."""


def generate(run, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
             seed: int = 0) -> list[int]:
  """The ids generated after ``prompt`` (module docstring)."""
  import jax
  import jax.numpy as jnp
  ids = _ids(run, tokenizer, prompt)
  cfg = run.task.config
  if temperature == 0:
    return greedy_batch(run, tokenizer, [ids], max_new_tokens)[0]
  window = min(cfg.max_len, len(ids) + max_new_tokens)
  model = run.task.model('none')
  params = jax.tree_util.tree_map(jnp.asarray, run.variables)
  logits_at = jax.jit(lambda v, toks, i: model.apply(v, toks)[0, i])
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(max_new_tokens):
    ctx = (ids + out)[-window:]
    toks = np.zeros((1, window), np.int32)
    toks[0, :len(ctx)] = ctx
    logits = np.asarray(logits_at(params, toks, len(ctx) - 1), np.float64)
    z = logits / temperature
    p = np.exp(z - z.max())
    nxt = int(rng.choice(len(p), p=p / p.sum()))
    if nxt == tokenizer.eot_id:
      break
    out.append(nxt)
  return out


def _ids(run, tokenizer, prompt: str, where: str = '--prompt') -> list[int]:
  ids = [int(i) for i in tokenizer.encode(prompt)]
  if not ids:
    raise SampleError(f'{where} is empty after tokenizing; give some text')
  cfg = run.task.config
  if max(ids) >= cfg.vocab_size:
    raise SampleError(f'{where} has token id {max(ids)}, beyond the model vocabulary '
                      f'{cfg.vocab_size}')
  return ids


def greedy_batch(run, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
  """Greedy continuations of token-id prompts with a KV cache, cut before end-of-text.

  Raises:
    SampleError: a prompt that fills the model's context (a KV cache does not slide).
  """
  longest = max(len(p) for p in prompts)
  if longest >= run.task.config.max_len:
    raise SampleError(f"a prompt has {longest} tokens; the model's context is "
                      f'{run.task.config.max_len}, which leaves no room to generate greedily '
                      '(--temperature above 0 keeps the latest tokens instead)')
  import jax
  import jax.numpy as jnp
  from models.kv_decode import greedy_generate
  params = jax.tree_util.tree_map(jnp.asarray, run.variables['params'])
  return greedy_generate(run.task.arch, run.task.config, params, prompts, max_new_tokens,
                         tokenizer.eot_id)


def read_prompts(path: str) -> list[str]:
  """The prompts of ``path``: each line of a text file, or each ``.jsonl`` row's ``"prompt"``."""
  import json
  from pathlib import Path
  try:
    lines = Path(path).read_text(encoding='utf-8').splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise SampleError(f"--prompts '{path}' cannot be read: "
                      f"{getattr(e, 'strerror', None) or e.__class__.__name__}") from None
  if not path.endswith('.jsonl'):
    prompts = [l for l in lines if l.strip()]
  else:
    prompts = []
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        row = None
      if not (isinstance(row, dict) and isinstance(row.get('prompt'), str)):
        raise SampleError(f'--prompts {path} line {number}: a row needs a string "prompt"')
      prompts.append(row['prompt'])
  if not prompts:
    raise SampleError(f"--prompts '{path}' holds no prompt")
  return prompts


def main(argv=None, prog: str = 'python -m training.sample') -> int:
  """The command line; ``prog``: the command's name in the usage line and at the start of every
  message (without ``python -m``); the script ``sample.py`` passes its own, as train.py does."""
  name = prog.removeprefix('python -m ')
  p = OneLineParser(prog=prog,
                    description="Print a text run's continuation of a prompt.")
  p.add_argument('run_dir', metavar='RUN_DIR', help="a gpt/llama train.py run's --out folder")
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument('--prompt', help='the text to continue')
  which.add_argument('--prompts', metavar='FILE',
                     help='continue every prompt of FILE (a line each, or .jsonl rows with '
                          '"prompt"); prints a JSON line {"prompt", "completion"} per prompt')
  p.add_argument('--max-new-tokens', type=int, default=64, metavar='N',
                 help='tokens to generate at most (default: 64)')
  p.add_argument('--temperature', type=float, default=0.0, metavar='T',
                 help='0: greedy; above 0: sample from softmax(logits / T) (default: 0)')
  p.add_argument('--seed', type=int, default=0, help='seed of the sampling (default: 0)')
  p.add_argument('--checkpoint', choices=('best', 'last'), default=None,
                 help="the run's best step (kept by --keep-best) or its last (default: best "
                      'when the run kept one)')
  p.add_argument('--base', default=None, metavar='HF_FOLDER',
                 help="a LoRA run's base checkpoint, if it moved since training (checked against "
                      "the run's record)")
  args = p.parse_args(argv)
  try:
    return _sample(args, name)
  except KeyboardInterrupt:
    print(f'{name}: interrupted', file=sys.stderr)
    return 130


def _sample(args, name: str = 'training.sample') -> int:
  from remat.targets import prefer_cpu_without_gpu
  prefer_cpu_without_gpu()
  from training.data.text_source import run_tokenizer
  from training.run.bounds import BoundsError, check_seed
  from training.run.saved_run import RunReadError, load_run
  try:
    if args.max_new_tokens < 1:
      raise SampleError(f'--max-new-tokens must be >= 1, got {args.max_new_tokens}')
    if not (args.temperature >= 0 and np.isfinite(args.temperature)):
      raise SampleError(f'--temperature must be a finite number >= 0, got {args.temperature}')
    check_seed(args.seed)
    run = load_run(args.run_dir, lambda m: print(f'{name}: warning: {m}',
                                                 file=sys.stderr), args.checkpoint,
                   base_from=args.base)
    if run.task.is_vision:
      raise SampleError(f"'{args.run_dir}' is a {run.task.arch} run; sampling needs a gpt or "
                        'llama run')
    context = run.task.config.max_len
    if args.max_new_tokens > context:   # 1000000000 ran for days without a word
      raise SampleError(f"--max-new-tokens must be <= the model's context of {context} tokens, "
                        f'got {args.max_new_tokens}')
    tokenizer = run_tokenizer(args.run_dir)
    if args.prompts is None:
      outs = [generate(run, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                       args.seed)]
    else:
      texts = read_prompts(args.prompts)
      ids = [_ids(run, tokenizer, t, f'--prompts {args.prompts} prompt {i + 1}')
             for i, t in enumerate(texts)]
      outs = []
      for i in range(0, len(ids), PROMPT_BATCH):
        if args.temperature == 0:
          outs += greedy_batch(run, tokenizer, ids[i:i + PROMPT_BATCH], args.max_new_tokens)
        else:
          outs += [generate(run, tokenizer, t, args.max_new_tokens, args.temperature,
                            args.seed + i + j) for j, t in enumerate(texts[i:i + PROMPT_BATCH])]
  except (SampleError, RunReadError, BoundsError, ValueError) as e:
    print(f'{name}: error: {e}', file=sys.stderr)
    return 2
  if args.prompts is None:
    print(tokenizer.decode(outs[0]))
  else:
    import json
    for text, out in zip(texts, outs):
      print(json.dumps({'prompt': text, 'completion': tokenizer.decode(out)}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
