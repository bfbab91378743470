"""Small stacks shared by the layout tests, and a walker over a traced program's equations."""

import jax
import jax.numpy as jnp

from remat import scan_layers

L, B, D, H = 8, 64, 32, 64   # the residual tanh MLP: layers, batch, width, hidden


def mlp_args():
  """Stacked ``(w1 [L, D, H], w2 [L, H, D])`` and a batch ``[B, D]``."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return ((jax.random.normal(k1, (L, D, H)) * 0.1, jax.random.normal(k2, (L, H, D)) * 0.1),
          jax.random.normal(jax.random.PRNGKey(1), (B, D)))


def mlp_loss(spec, layout):
  """``loss(params, x)`` of the MLP stacked with ``scan_layers`` under ``spec`` and ``layout``."""
  layer = lambda w, h: h + jnp.tanh(h @ w[0]) @ w[1]
  return lambda params, x: jnp.mean(scan_layers(layer, params, x, policy=spec, layout=layout) ** 2)


def eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters, depth first."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for q in (p if isinstance(p, (tuple, list)) else (p,)):
        if isinstance(q, jax.extend.core.ClosedJaxpr):
          yield from eqns(q.jaxpr)
        elif isinstance(q, jax.extend.core.Jaxpr):
          yield from eqns(q)
