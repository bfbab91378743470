"""A training run: its settings, its folder on disk, and what keeps both trustworthy.

- :mod:`training.run.settings`: :class:`~training.run.settings.TrainConfig`, its checks, and
  the model, task and policy it resolves to;
- :mod:`training.run.rundir`: the run folder (``--out``): path checks, the one-writer lock,
  the run record, ``metrics.jsonl``;
- :mod:`training.run.checkpoints`: Orbax checkpoints, never non-finite, digest-verified,
  restored with fallback (:mod:`training.run.orbax_noise` keeps Orbax's own reports of a
  failed save off the terminal);
- :mod:`training.run.loss_guard`: keeps a blown-up (but finite) state out of the checkpoints;
- :mod:`training.run.resume_check`: which settings a ``--resume`` must keep;
  :mod:`training.run.record_check`: a resume's checks against the run's record;
- :mod:`training.run.saved_run`: a finished or stopped run read back (for export and sampling).

What each guarantees: docs/training-safety.md.
"""
