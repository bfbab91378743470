"""How the models' chunked backward passes split their rows (GELU MLP, Llama's MLP, attention),
and the zeros their loop carries start from.

Shared by :mod:`models.layers`, :mod:`models.swiglu`, :mod:`models.attention` and
:mod:`models.blockwise_attention` (its zeros), which import it and nothing of each other for it.
"""

import jax

# Rows (tokens) per step of the chunked backward passes (gelu_dense; models/llama.py's MLP).
BACKWARD_ROWS = 128
# ... in at most this many steps: a loop step is one launch of each matmul on a GPU, so at real
# sizes (16k tokens) the chunks grow (1024 rows) rather than the launches; the working set is
# still a sixteenth of one pass's.
MAX_BACKWARD_CHUNKS = 16


def row_chunks(rows: int, size: int = BACKWARD_ROWS) -> int:
  """How many equal chunks of about ``size`` rows (at least ``size``; 1 if fewer; at most
  :data:`MAX_BACKWARD_CHUNKS`) ``rows`` splits into."""
  n = max(1, min(rows // size, MAX_BACKWARD_CHUNKS))
  while rows % n:
    n -= 1
  return n


def zeros_after(shape, dtype, like):
  """Zeros of ``shape`` that XLA can make only once ``like`` (the incoming cotangent) exists.

  For the chunked backward passes' carries. Constant zeros were made at once: in
  an unrolled stack XLA's GPU pipeline made every layer's at the start of the
  backward pass and held all of them (our tiny GPT, 8 layers, ``dots``, H100
  plan: seven zeroed ``[1024, 512]`` float32 ``dh`` buffers at the peak).
  ``(x != x) & (x == x)`` is false for every ``x``, NaN included, and XLA does not
  fold it to a constant.
  """
  one = like[(0,) * like.ndim]
  return jax.lax.broadcast_in_dim(((one != one) & (one == one)).astype(dtype), shape, ())
