"""Text table, footer and PNG of a :func:`baselines.compare.compare` result (figures defined there)."""

from __future__ import annotations

JAX_WARMUP_STEPS = 2   # remat.measuring.time_step's warm-up


def format_bytes(n) -> str:
  from remat.memory import format_bytes as fb
  return '-' if n is None else fb(n)


def format_flops(n) -> str:
  if n is None:
    return '-'
  for unit, scale in (('P', 1e15), ('T', 1e12), ('G', 1e9), ('M', 1e6), ('K', 1e3)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{n:.0f} '


def format_seconds(s) -> str:
  if s is None:
    return '-'
  return f'{s * 1e3:.1f} ms' if s < 1 else f'{s:.2f} s'


def header(result: dict) -> str:
  env = result['environment']
  if 'seq_len' in env:
    b, L = env['batch_size'], env['seq_len']
    dims = (f'seq {L} (JAX windows [{b}, {L + 1}], torch input_ids [{b}, {L + 1}]: '
            f'{b * L} predicted tokens each)')
  else:
    dims = f"image {env['image_size']}x{env['image_size']}"
  return (f"# train step, {env['model']} {env['config']}, batch {env['batch_size']} x {dims}, "
          f"float32, CPU, one process; jax {env['jax']} ({env['backend']} backend), "
          f"torch {env['torch']} ({env['torch_threads']} threads), "
          f"transformers {env['transformers']}; host malloc {env['host_malloc']}; "
          f"median of {env['steps']} steps"
          + ('; JAX step: AdamW applied layer by layer in the backward pass (--fused-update)'
             if env.get('jax_step') == 'fused update' else '')
          + (f"; JAX layout {env['jax_layout']}" if env.get('jax_layout', 'auto') != 'auto'
             else ''))


_COLS = (f"{'family':<11}{'side':<9}{'policy':<12}{'peak':>12}{'activation':>12}{'FLOPs':>11}"
         f"{'recompute':>10}{'time':>11}{'peak J/T':>10}{'time J/T':>10}")


def format_table(result: dict) -> str:
  lines = [header(result), _COLS]
  for r in result['families']:
    for side, name in (('jax', 'JAX'), ('torch', 'PyTorch')):
      d = r[side]
      policy = d['policy'] if side == 'jax' else r['family']
      line = (f"{r['family'] if side == 'jax' else '':<11}{name:<9}{policy:<12}"
              f"{format_bytes(d['peak_bytes']):>12}{format_bytes(d['activation_bytes']):>12}"
              f"{format_flops(d['step_flops']):>11}{d['recompute_ratio']:>9.3f}x"
              f"{format_seconds(d['step_seconds']):>11}")
      if side == 'torch':
        line += ''.join(f'{x:>9.2f}x' if x is not None else f"{'-':>10}"
                        for x in (r['peak_ratio'], r['time_ratio']))
      lines.append(line)
  return '\n'.join(lines)


def footer(result: dict) -> list[str]:
  env = result['environment']
  lines = [
      '# peak: bytes live at the peak of one whole train step. JAX: compiled plan, argument + '
      'output - alias + temp from XLA memory_analysis() (compile only, CPU backend, state donated; '
      'an upper bound, not an allocator measurement). PyTorch: MemTracker Total at its peak, one '
      'steady-state step on CPU (live tensor storage; no allocator caching, fragmentation or '
      'oneDNN scratch). Plan vs allocator trace: they measure differently.',
      '# activation: bytes kept for backward. JAX: residual_bytes (arrays the VJP keeps, from the '
      'jaxpr, before XLA buffer reuse; blind to recompute working sets). PyTorch: '
      "saved_activation_bytes (MemTracker 'Activation' live right after forward+loss). Different "
      'methods: compare across families, not digit by digit.',
      '# FLOPs: matmul+conv FLOPs of the step, recompute included. JAX: our jaxpr walk '
      '(dot_general, conv). PyTorch: FlopCounterMode (mm/bmm/conv/attention only). recompute = '
      "FLOPs / none's FLOPs on the same side.",
      f"# time: median of {env['steps']} steps in this process. JAX: the compiled step after "
      f'{JAX_WARMUP_STEPS} warm-up steps (measure(..., run=True)). PyTorch: eager steps after its '
      'warm-up, memory and FLOP steps. peak J/T, time J/T: JAX / PyTorch of the same family.',
  ]
  lines.append(
      f"# host malloc: {env['host_malloc']} for both sides. XLA CPU allocates the step's temp "
      'buffer afresh every step and the kernel zero-fills each new page on first touch; '
      'GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (set before python starts) puts large blocks on '
      'transparent huge pages, which makes those faults rare '
      '(README: Faster steps on a Linux CPU).')
  opt = result['optimizer']
  j, t = opt['jax'], opt['torch']
  same = (f"AdamW b1 {t['b1']}, b2 {t['b2']}, eps {t['eps']:g}, weight decay "
          f"{t['weight_decay']}, global-norm clip {t['grad_clip']}")
  if opt['differences']:
    diff = ', '.join(f"{k} JAX {j.get(k, 'global')} vs torch {t.get(k, 'global')}"
                     for k in opt['differences'])
    lines.append(f'# optimizer: DIFFERENT settings: {diff}; lr JAX {j["lr"]}, torch {t["lr"]}')
  else:
    lines.append(f"# optimizer: both {same}; only lr differs (JAX {j['lr']}, torch {t['lr']}), "
                 'which changes no figure here; torch AdamW runs its default CPU implementation')
  shared = sorted({r['jax_policy'] for r in result['families'] if r['jax_shared_with']})
  mapping = ', '.join(f'{f} -> {p}' for f, p in result['family_policy'].items())
  lines.append(f'# families (torch -> our policy): {mapping}'
               + (f"; JAX {', '.join(shared)} measured once, repeated on each family's row"
                  if shared else ''))
  if 'seq_len' in env:
    lines.append(f"# gpt tokens: both predict {env['predicted_tokens']} tokens; the torch forward "
                 f"runs over {env['seq_len'] + 1} positions (last logits unused), JAX over "
                 f"{env['seq_len']}")
  fams = {r['family'] for r in result['families']}
  if 'sqrt' in fams:
    lines.append("# sqrt: torch checkpoint_sequential leaves its last segment un-checkpointed; "
                 'JAX checkpoints every segment' + ('; ResNet: torch segments all blocks, JAX '
                                                    'each stage' if env['arch'] == 'resnet' else ''))
  for s in result['skipped']:
    lines.append(f"# skipped {s['family']}: {s['reason']}")
  return lines


def plot(result: dict, path: str) -> None:
  """PNG: grouped bars of peak memory per family, JAX vs PyTorch, time ratio annotated."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  rows = result['families']
  fams = [r['family'] for r in rows]
  most = max(max(r['jax']['peak_bytes'], r['torch']['peak_bytes']) for r in rows)
  unit, scale = ('GiB', 2**30) if most >= 2**30 else ('MiB', 2**20)
  jax_gib = [r['jax']['peak_bytes'] / scale for r in rows]
  torch_gib = [r['torch']['peak_bytes'] / scale for r in rows]
  x = range(len(rows))
  w = 0.38
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 2), 5))
  ax.bar([i - w / 2 for i in x], jax_gib, w, label='JAX (XLA plan peak)', color='C0')
  ax.bar([i + w / 2 for i in x], torch_gib, w, label='PyTorch (MemTracker peak)', color='C1')
  top = max(jax_gib + torch_gib)
  for i, r in enumerate(rows):
    ratio = r['time_ratio']
    text = f"time J/T {ratio:.2f}x" if ratio is not None else 'time J/T -'
    ax.annotate(text, (i, max(jax_gib[i], torch_gib[i]) + 0.02 * top), ha='center', fontsize=8)
  ax.set_xticks(list(x))
  ax.set_xticklabels([f"{f}\n(JAX {r['jax_policy']})" for f, r in zip(fams, rows)], fontsize=8)
  ax.set_ylabel(f'peak memory of the train step ({unit})')
  ax.set_ylim(0, top * 1.12)
  import textwrap
  ax.set_title(textwrap.fill(header(result).lstrip('# ').split('; ')[0], 90), fontsize=8)
  ax.grid(axis='y', alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
