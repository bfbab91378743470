"""Hugging Face checkpoints in and out of our models: ``save_pretrained`` folders, no torch.

- :mod:`models.hf.load`: a folder (``config.json`` + safetensors) into our config and
  variables, checked leaf by leaf (``--init-from``);
- :mod:`models.hf.layout`: Hugging Face parameter names and layouts <-> ours, per family;
- :mod:`models.hf.finetune`: a loaded checkpoint reshaped for a fine-tune (a new
  classifier, a ViT at another image side);
- :mod:`models.hf.export`: our GPT-2 and Llama variables back into a folder
  (``python -m training.export``); :mod:`models.hf.export_vision`: ViT and ResNet.
"""
