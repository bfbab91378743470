"""Models whose repeated blocks are stacked (and rematerialised) by :mod:`remat.stack`.

- the families: :mod:`models.gpt` (GPT-2), :mod:`models.llama`, :mod:`models.vit`
  (+ :mod:`models.vit_positions`), :mod:`models.resnet`;
- their pieces: :mod:`models.layers` (LayerNorm, the GELU MLP), :mod:`models.attention`,
  :mod:`models.dropout`, :mod:`models.chunking` (the chunked backward passes' row counts),
  :mod:`models.chunked_loss` (the language models' loss);
- :mod:`models.tasks`: per family, how a model is built, fed and scored;
- :mod:`models.hf`: Hugging Face checkpoints in and out.

Nothing here imports the application (``training``, ``bench``, ``baselines``,
``configs``): ``tests/test_layering.py``.
"""

from models.gpt import GPT, GPTConfig, TAGS as GPT_TAGS

__all__ = ['GPT', 'GPTConfig', 'GPT_TAGS']
