"""``python -m training.sample RUN_DIR --prompt TEXT``: a text run's continuation of a prompt.

Loads the run's latest checkpoint and the tokenizer it trained with (its saved
copy; bytes for a byte-level run), then generates one token at a time: greedy
(the most likely token) at ``--temperature 0``, else sampled from the softmax
of the logits divided by the temperature (seeded by ``--seed``). It stops
after ``--max-new-tokens`` or at the tokenizer's end-of-text token, and
prints the continuation alone.

There is no KV cache: every step reruns the model over a fixed window (the
prompt and the tokens so far, right-padded to one length, so the step is
compiled once; a causal model's logit at a position does not see the
padding after it). At the sizes trained here that costs milliseconds a token.
Beyond the model's ``max_len`` the window keeps the latest ``max_len`` tokens.
"""

from __future__ import annotations

import sys

import numpy as np

from training.arguments import OneLineParser


class SampleError(ValueError):
  """Unusable sampling settings or run; the message is one line."""


def generate(run, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
             seed: int = 0) -> list[int]:
  """The ids generated after ``prompt`` (module docstring)."""
  import jax
  import jax.numpy as jnp
  ids = [int(i) for i in tokenizer.encode(prompt)]
  if not ids:
    raise SampleError('--prompt is empty after tokenizing; give some text')
  cfg = run.task.config
  if max(ids) >= cfg.vocab_size:
    raise SampleError(f'the prompt has token id {max(ids)}, beyond the model vocabulary '
                      f'{cfg.vocab_size}')
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
    if temperature == 0:
      nxt = int(np.argmax(logits))
    else:
      z = logits / temperature
      p = np.exp(z - z.max())
      nxt = int(rng.choice(len(p), p=p / p.sum()))
    if nxt == tokenizer.eot_id:
      break
    out.append(nxt)
  return out


def main(argv=None) -> int:
  p = OneLineParser(prog='python -m training.sample',
                    description="Print a text run's continuation of a prompt.")
  p.add_argument('run_dir', metavar='RUN_DIR', help="a gpt/llama train.py run's --out folder")
  p.add_argument('--prompt', required=True, help='the text to continue')
  p.add_argument('--max-new-tokens', type=int, default=64, metavar='N',
                 help='tokens to generate at most (default: 64)')
  p.add_argument('--temperature', type=float, default=0.0, metavar='T',
                 help='0: greedy; above 0: sample from softmax(logits / T) (default: 0)')
  p.add_argument('--seed', type=int, default=0, help='seed of the sampling (default: 0)')
  p.add_argument('--base', default=None, metavar='HF_FOLDER',
                 help="a LoRA run's base checkpoint, if it moved since training (checked against "
                      "the run's record)")
  args = p.parse_args(argv)
  try:
    return _sample(args)
  except KeyboardInterrupt:
    print('training.sample: interrupted', file=sys.stderr)
    return 130


def _sample(args) -> int:
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
    run = load_run(args.run_dir, lambda m: print(f'training.sample: warning: {m}',
                                                 file=sys.stderr), base_from=args.base)
    if run.task.is_vision:
      raise SampleError(f"'{args.run_dir}' is a {run.task.arch} run; sampling needs a gpt or "
                        'llama run')
    context = run.task.config.max_len
    if args.max_new_tokens > context:   # 1000000000 ran for days without a word
      raise SampleError(f"--max-new-tokens must be <= the model's context of {context} tokens, "
                        f'got {args.max_new_tokens}')
    tokenizer = run_tokenizer(args.run_dir)
    out = generate(run, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                   args.seed)
  except (SampleError, RunReadError, BoundsError, ValueError) as e:
    print(f'training.sample: error: {e}', file=sys.stderr)
    return 2
  print(tokenizer.decode(out))
  return 0


if __name__ == '__main__':
  sys.exit(main())
