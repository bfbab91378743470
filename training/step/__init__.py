"""The compiled train step: what one optimizer step computes, where, and under which policy.

- :mod:`training.step.train_step`: the optimizer, the train state and the jitted train and
  eval steps (pure functions of their inputs);
- :mod:`training.step.fused_step`: the step with the optimizer applied layer by layer in the
  backward pass (:func:`remat.fused_update`; ``--fused-update`` of ``bench.report`` and
  ``baselines.compare``);
- :mod:`training.step.autoremat`: ``--remat=auto:...``, the policy of least recompute whose
  compiled plan of the step fits;
- :mod:`training.step.mesh`: the step on a device mesh (``--mesh``: FSDP, data parallelism,
  several processes); :mod:`training.step.mesh_plan`: its per-device memory plan.
"""
