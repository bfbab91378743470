"""LoRA and QLoRA: low-rank adapters on a frozen (optionally quantized) base.

:mod:`models.lora.spec` (what a run adapts), :mod:`models.lora.dense` (the adapted
projection and its derivative), :mod:`models.lora.quantize` (int8 / nf4 storage),
:mod:`models.lora.params` (the parameter tree in frozen and trained parts).
"""
