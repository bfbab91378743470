"""What a run trains on: every data source of ``train.py``, and its one error type.

Language models (``--model gpt|llama``):

- :mod:`training.data.text_source`: the one place that picks a run's tokenizer and text module;
- :mod:`training.data.byte_text`: raw bytes of this Python's standard library, a file or a
  folder (the README's run; no download);
- :mod:`training.data.tokenizer`: text to token ids (bytes, or a Hugging Face ``tokenizer.json``);
- :mod:`training.data.packed_text`: text files and ``.jsonl`` rows tokenized once into an
  on-disk cache and packed into windows with segment ids, positions and a loss mask.

Vision models (``--model vit|resnet``):

- :mod:`training.data.vision_source`: the one place that picks procedural shapes or a folder;
- :mod:`training.data.shapes`: procedural shapes, one per image (no download);
- :mod:`training.data.image_folder`: a person's own images, one subfolder per class.
"""


class DataError(ValueError):
  """Unusable data path or too little text; the message is one line."""
