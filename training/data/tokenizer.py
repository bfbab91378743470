"""Turning text into token ids: raw bytes, or a Hugging Face ``tokenizer.json``.

:func:`load_tokenizer` gives one of two tokenizers with the same small interface
(``name``, ``vocab_size``, ``eot_id``, ``encode``, ``decode``):

* :class:`ByteTokenizer`: ids are the UTF-8 bytes (vocabulary 256), the
  default when no tokenizer is named: the README's byte-level GPT.
* :class:`HFTokenizer`: a ``tokenizer.json`` (or a folder holding one) loaded
  with the ``tokenizers`` package alone (no ``transformers`` at run time).
  Its end-of-text token, which separates documents, is the folder's
  ``tokenizer_config.json`` ``eos_token`` when there is one, else the first
  of the usual names (:data:`EOT_NAMES`) that the vocabulary holds.

Errors are :class:`TokenizerError` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# End-of-text tokens of common families, in the order tried: GPT-2 / Qwen, Llama 3 base,
# Llama 3 chat, Llama 2 / Mistral / SmolLM's </s>, Gemma.
EOT_NAMES = ('<|endoftext|>', '<|end_of_text|>', '<|eot_id|>', '</s>', '<eos>')
TOKENIZER_FILE = 'tokenizer.json'
# Files a Hugging Face tokenizer folder may hold besides tokenizer.json; export copies them.
COMPANION_FILES = ('tokenizer_config.json', 'special_tokens_map.json')


class TokenizerError(ValueError):
  """A tokenizer that cannot be used; the message is one line."""


class ByteTokenizer:
  """UTF-8 bytes as token ids (vocabulary 256); no end-of-text token."""
  name = 'bytes'
  vocab_size = 256
  eot_id = None
  path = None

  def encode(self, text: str, special: bool = True) -> np.ndarray:
    del special
    return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str], special: bool = True) -> list[np.ndarray]:
    return [self.encode(t, special) for t in texts]

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode('utf-8', errors='replace')


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file.

  Attributes:
    path: the ``tokenizer.json`` file.
    name: how metrics and logs name it (the file's path).
    vocab_size: ids are ``0..vocab_size - 1`` (added tokens included).
    eot_id: the end-of-text id that ends each document.
  """

  def __init__(self, path: Path):
    from tokenizers import Tokenizer
    self.path = path
    self.name = str(path)
    try:
      self._tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises its own exception type
      raise TokenizerError(f"--tokenizer '{path}' is not a tokenizer.json the tokenizers package "
                           f'can read: {str(e).splitlines()[0] if str(e) else type(e).__name__}'
                           ) from None
    # get_vocab_size(with_added_tokens=True) counts tokens, but added ids may leave gaps:
    # the embedding must hold the largest id.
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1 if vocab else 0
    self.eot_token, self.eot_id = self._end_of_text(vocab)

  def _end_of_text(self, vocab: dict[str, int]) -> tuple[str, int]:
    config = self.path.parent / 'tokenizer_config.json'
    if config.is_file():
      try:
        eos = json.loads(config.read_text()).get('eos_token')
      except (OSError, ValueError, AttributeError):
        eos = None
      eos = eos.get('content') if isinstance(eos, dict) else eos
      if isinstance(eos, str) and eos in vocab:
        return eos, vocab[eos]
    for name in EOT_NAMES:
      if name in vocab:
        return name, vocab[name]
    raise TokenizerError(f"--tokenizer '{self.path}' has no end-of-text token to separate "
                         f"documents (looked for tokenizer_config.json's eos_token and "
                         f"{', '.join(EOT_NAMES)})")

  def encode(self, text: str, special: bool = True) -> np.ndarray:
    """Ids of ``text``; ``special``: with the post-processor's tokens (a BOS, for Llama)."""
    return np.asarray(self._tok.encode(text, add_special_tokens=special).ids, np.int32)

  def encode_batch(self, texts: list[str], special: bool = True) -> list[np.ndarray]:
    """:meth:`encode` of many texts at once (the Rust library's threads)."""
    return [np.asarray(e.ids, np.int32)
            for e in self._tok.encode_batch(texts, add_special_tokens=special)]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def find_tokenizer(path) -> Path | None:
  """``path`` if it is a file, ``path/tokenizer.json`` if that exists, else None."""
  p = Path(path)
  if p.is_file():
    return p
  return p / TOKENIZER_FILE if (p / TOKENIZER_FILE).is_file() else None


def load_tokenizer(path) -> ByteTokenizer | HFTokenizer:
  """The tokenizer at ``path`` (a tokenizer.json or a folder holding one); None or 'bytes': bytes.

  Raises:
    TokenizerError: one line, for a missing or unreadable tokenizer.
  """
  if path is None or str(path) == 'bytes':
    return ByteTokenizer()
  file = find_tokenizer(path)
  if file is None:
    raise TokenizerError(f"--tokenizer '{path}': no such file, nor a folder holding "
                         f"{TOKENIZER_FILE}; give a tokenizer.json or its folder (or 'bytes')")
  return HFTokenizer(file)
