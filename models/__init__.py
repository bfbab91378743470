"""Models whose repeated blocks are stacked (and rematerialised) by :mod:`remat.stack`."""

from models.gpt import GPT, GPTConfig, TAGS as GPT_TAGS

__all__ = ['GPT', 'GPTConfig', 'GPT_TAGS']
