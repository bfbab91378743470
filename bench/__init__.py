"""The model-zoo benchmarks: remat's measurements applied to the shipped GPT, ViT and ResNet configs.

An application of the ``remat`` library (it uses only its public API): ``python -m
bench.report`` is the zoo's policy table and sweeps, :mod:`bench.zoo` adapts each
model family to :func:`remat.measure`.
"""
