"""baselines.profile: per-category step times on both sides, from HLO and aten op names."""

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

from baselines import profile  # noqa: E402


def test_hlo_categories_of_a_compiled_function():
  def f(x, w, q, k):
    y = jnp.tanh(x @ w)                            # weight matmul, fused or not
    s = jnp.einsum('bqd,bkd->bqk', q, k)           # batched: attention
    return y, s, x.T.copy()                        # a transpose: data movement only
  args = (jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((4, 16, 8)), jnp.ones((4, 16, 8)))
  cats = profile.hlo_categories(jax.jit(f).lower(*args).compile().as_text())
  found = set(cats.values())
  assert {'matmul & conv', 'attention', 'other'} <= found
  assert found <= set(profile.CATEGORIES) | {None}


def test_hlo_loops_are_not_counted():
  def f(x, n):  # a traced trip count keeps the loop a loop
    return jax.lax.fori_loop(0, n, lambda i, c: c * 2.0 + 1.0, x)
  text = jax.jit(f).lower(jnp.ones(8), 3).compile().as_text()
  cats = profile.hlo_categories(text)
  assert any(name.startswith('while') and c is None for name, c in cats.items())


@pytest.mark.parametrize('op,category', [
    ('aten::mm', 'matmul & conv'), ('aten::addmm', 'matmul & conv'),
    ('aten::_scaled_dot_product_flash_attention_for_cpu_backward', 'attention'),
    ('aten::bmm', 'attention'), ('aten::copy_', 'copies'), ('aten::gelu', 'other'),
    ('Optimizer.step#AdamW.step', 'other'),
])
def test_torch_categories(op, category):
  assert profile.torch_category(op) == category


@pytest.mark.extended
def test_both_sides_per_family(capsys):
  code = profile.main(['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2',
                       '--seq-len', '32', '--families', 'none'])
  out = capsys.readouterr().out.splitlines()
  assert code == 0
  assert out[0].startswith('# seconds per train step by category, gpt2 tiny, batch 2 x seq 32')
  for line in (out[2], out[3]):
    seconds = [float(v) for v in line.split()[-10::2]]   # four categories and the total
    assert len(seconds) == 5 and seconds[-1] > 0
    assert sum(seconds[:4]) == pytest.approx(seconds[-1], abs=0.02)
  assert out[2].split()[:3] == ['none', 'JAX', 'none'] and out[3].split()[:2] == ['PyTorch', 'none']


def test_bad_family_is_one_line(capsys):
  assert profile.main(['--model', 'gpt2', '--batch-size', '2', '--families', 'bogus']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('baselines.profile: error: unknown policy family')
