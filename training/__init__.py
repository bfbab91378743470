"""The trainer behind ``train.py``: GPT-2, Llama, ViT and ResNet under a named remat policy.

The entry points are here; what they use lives in three folders, by concern:

- :mod:`training.cli` (``train.py``'s flags), :mod:`training.trainer` (the run: checks, data,
  state, the compiled step, the memory line) and :mod:`training.loop` (its steps, evaluation,
  metrics and checkpoints); :mod:`training.export` (``export.py``: a run
  to a Hugging Face folder) and :mod:`training.sample` (``sample.py``: a text run continues a
  prompt), whose scripts beside ``train.py`` run them from any folder;
- :mod:`training.data`: what a run trains on (bytes, tokenized and packed ``.jsonl`` or text,
  procedural shapes, image folders);
- :mod:`training.run`: a run's settings and its files on disk, and what keeps them trustworthy
  (run folder, checkpoints, loss guard, resume check, reading a run back);
- :mod:`training.step`: the compiled train step (optimizer and state, the fused-update step,
  ``--remat=auto``, device meshes and their per-device plans).

The model families and their losses are :mod:`models` (which imports nothing from here).
"""
