"""What a run is: :class:`TrainConfig`, its checks, and the model, task and policy it resolves to.

Everything here runs before anything compiles or is written, so a bad flag
costs nothing (the CLI turns :class:`RunError` into one line and exit code 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from configs import DEFAULT_CONFIG, NamedConfig, config_names, load_config, with_dtype
from models.lora.spec import QUANTIZE, LoraSpec, resolve_targets
from models.tasks import Task
from remat.auto_budget import is_auto, parse_budget
from remat.layout import check_layout
from remat.policies import Policy, get_policy
from training.data.text_source import HF_CONFIG_PREFIX, load_named, tokenizer_for_run
from training.run import bounds
from training.run import resume_check
from training.run import rundir
from training.run.loss_guard import GuardConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of a run; built once from the named config plus flags.

  ``seq_len`` applies to GPT configs, ``image_size`` to vision configs (None:
  the model config's image size). ``model``, if set, is the arch the config
  must have. ``dtype`` (None: the model config's) overrides the model config's
  compute dtype (docs/precision.md). ``restart`` and ``allow_changed`` act on
  one invocation and are not recorded; ``spike_*`` are the loss guard's
  thresholds (:mod:`training.run.loss_guard`). ``lora`` (a rank; None: full
  fine-tuning) with ``lora_alpha`` (None: twice the rank), ``lora_dropout``,
  ``lora_targets`` (None: every projection) and ``quantize`` make a LoRA or
  QLoRA run (:func:`lora_spec`, docs/finetuning.md).
  """
  config: str = 'tiny'
  remat: str = 'sqrt'
  layout: str = 'auto'   # how the layer stack becomes a program (remat.layout.LAYOUTS)
  model: str | None = None
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 128
  image_size: int | None = None
  lr: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  data: str | None = None
  out: str | None = None
  resume: bool = False
  init_from: str | None = None
  eval_every: int = 50
  eval_batches: int = 8
  save_every: int = 100
  memory_report: bool = True
  skip_nonfinite: int = 0
  mesh: str | None = None  # --mesh AXIS=N,...; None: one device (training/step/mesh.py)
  dtype: str | None = None
  restart: bool = False
  allow_changed: str | None = None  # --allow-changed a,b: compared settings a resume may change
  spike_factor: float = GuardConfig.factor
  spike_margin: float = GuardConfig.margin
  spike_patience: int = GuardConfig.patience
  data_workers: int | None = None  # image folders: Grain worker processes (None: by core count)
  augment: str = 'crop+flip'  # image folders: none, flip, crop or crop+flip
  crop_scale: tuple[float, float] | None = None  # image folders: crop area range (None: 0.08-1)
  tensorboard: bool = False  # --tensorboard: scalars in <out>/tensorboard (tensorboardX)
  tokenizer: str | None = None  # None: --init-from's tokenizer, else bytes (training/data/tokenizer.py)
  grad_accum: int = 1  # --grad-accum K: microbatches per step (training/step/accumulate.py)
  # --remat=auto:BUDGET without --grad-accum: K is searched with the policy (remat.auto_levers)
  grad_accum_search: bool = False
  offload_optimizer: bool = False  # optimizer state in host memory (training/step/offload.py)
  eval_data: tuple[str, ...] = ()  # --eval-data files evaluated beside --data's held-out split
  eval_generate: int = 0  # --eval-generate N: greedy generation on N held-out prompts per set
  keep_best: str | None = None  # --keep-best METRIC: the best held-out step kept in <out>/best
  early_stop: int | None = None  # --early-stop P: stop after P evaluations without a better METRIC
  lora: int | None = None  # --lora RANK: adapters on a frozen base (models/lora)
  lora_alpha: float | None = None  # None: 2 * rank
  lora_dropout: float = 0.0
  lora_targets: str | None = None  # comma-separated projection names; None: all
  quantize: str | None = None  # int8 | nf4: the frozen base stored quantized (QLoRA)

  @property
  def out_dir(self) -> Path:
    if self.out:
      return Path(self.out)
    # A bfloat16 run of the same config and policy gets its own folder (float32 keeps the name).
    suffix = f'-{self.dtype}' if self.dtype not in (None, 'float32') else ''
    if self.lora is not None:   # an adapter run beside the full fine-tune of the same config
      suffix += f'-lora{self.lora}' + (f'-{self.quantize}' if self.quantize else '')
    return Path('runs') / (rundir.default_name(self.config, self.remat) + suffix)


class RunError(ValueError):
  """A setting that cannot be used; the message is one line."""


class DivergedError(RunError):
  """The run stopped at a non-finite loss or gradient; the checkpoints on disk are good."""


def _flag(name: str) -> str:
  return '--' + name.replace('_', '-')


def _check_positive(cfg: TrainConfig):
  try:   # every number in its range (training/run/bounds.py)
    bounds.check_numbers(cfg)
  except bounds.BoundsError as e:
    raise RunError(str(e)) from None
  if cfg.lora is None:
    for name in ('lora_alpha', 'lora_targets'):
      if getattr(cfg, name) is not None:
        raise RunError(f'{_flag(name)} sets up a LoRA run: pass --lora RANK with it (e.g. --lora 16)')
    if cfg.lora_dropout:
      raise RunError('--lora-dropout sets up a LoRA run: pass --lora RANK with it (e.g. --lora 16)')
  elif cfg.lora < 1:
    raise RunError(f'--lora must be >= 1 (the rank of the adapters), got {cfg.lora}')
  resume_check.parse_allowed(cfg.allow_changed)


def resolve(cfg: TrainConfig) -> tuple[NamedConfig, Task, int, Policy]:
  """Checks the config, the shapes and the policy (against the model's depth and tags).

  Returns:
    (named config, task, size, policy); size is the sequence length (GPT) or
    the image side (vision). policy is None for an ``auto`` budget, which
    :func:`train` resolves by compiling (:mod:`training.step.autoremat`).
  """
  _check_positive(cfg)
  named = with_dtype(load_named(cfg.config), cfg.dtype)
  named = with_lora(named, lora_spec(cfg, named.arch))
  if cfg.model is not None and cfg.model != named.arch:
    raise RunError(f"--model {cfg.model} does not match config {named.name} (a {named.arch} "
                   f"model); {cfg.model} configs: {', '.join(config_names(cfg.model))}")
  check_layout(cfg.layout)
  task = Task(named.model, cfg.layout)
  model_cfg = named.model
  if task.is_vision:
    size = model_cfg.image_size if cfg.image_size is None else cfg.image_size
    if task.arch == 'vit' and (size < 1 or size % model_cfg.patch_size):
      raise RunError(f'--image-size {size} does not fit config {named.name}: a ViT takes a '
                     f'multiple of its patch size {model_cfg.patch_size} (its positions are '
                     'resampled to that grid)')
    if task.arch == 'resnet' and size < 32:
      raise RunError(f'--image-size must be >= 32 for a ResNet, got {size}')
    # The model at the run's image side, with a classifier for the data's classes.
    from training.data.vision_source import num_classes
    named = dataclasses.replace(named, model=dataclasses.replace(
        model_cfg, image_size=size, num_classes=num_classes(cfg.data, model_cfg.num_classes)))
    task, model_cfg = Task(named.model, cfg.layout), named.model
    row, what = size * size * model_cfg.channels * 4, f'{size}x{size}x{model_cfg.channels} pixels'
  else:
    if cfg.image_size is not None:
      raise RunError(f'--image-size applies to vit and resnet configs; {named.name} is a gpt '
                     'config (use --seq-len)')
    size = cfg.seq_len
    if size > model_cfg.max_len:
      raise RunError(f'--seq-len {size} exceeds config {named.name} max_len {model_cfg.max_len}')
    # The tokenizer's vocabulary must fit the embedding (a fresh model is sized to it).
    named = tokenizer_for_run(cfg, named)[1]
    task = Task(named.model, cfg.layout)
    row, what = (size + 1) * bounds.LM_BYTES_PER_TOKEN, f'{size + 1} tokens'
  try:
    bounds.check_batch_memory(cfg.batch_size, row, what)
  except bounds.BoundsError as e:
    raise RunError(str(e)) from None
  from training.step.accumulate import AccumError, check as check_microbatches
  try:   # on a mesh, train() checks again with the mesh's batch shards
    check_microbatches(cfg.grad_accum, cfg.batch_size)
  except AccumError as e:
    raise RunError(str(e)) from None
  if is_auto(cfg.remat):   # a budget: checked here, resolved to a policy by train() (compiles)
    parse_budget(cfg.remat)
    return named, task, size, None
  policy = get_policy(cfg.remat, num_layers=task.num_layers)
  return named, task, size, policy.validate(task.num_layers, task.emitted_tags(size))


def lora_spec(cfg, arch: str) -> LoraSpec | None:
  """The adapters the ``--lora*``/``--quantize`` settings ask for (None without ``--lora``).

  ``cfg`` is a :class:`TrainConfig` or anything with those fields (bench.report's flags).

  Raises:
    RunError: one line: a rank below 1, a target no projection of ``arch`` has
      (naming those it has), a family without adapters, a bad alpha or dropout.
  """
  if cfg.quantize is not None and cfg.quantize not in QUANTIZE:
    raise RunError(f"--quantize must be one of {', '.join(QUANTIZE)}, got '{cfg.quantize}'")
  if cfg.lora is None:
    if cfg.quantize is not None:
      raise RunError('--quantize stores a LoRA run\'s frozen base: pass --lora RANK with it '
                     '(e.g. --lora 16 --quantize nf4)')
    return None
  try:
    alpha = float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora
    return LoraSpec(rank=cfg.lora, alpha=alpha, dropout=float(cfg.lora_dropout or 0.0),
                    targets=resolve_targets(arch, cfg.lora_targets), quantize=cfg.quantize)
  except ValueError as e:
    raise RunError(str(e)) from None


def with_lora(named: NamedConfig, spec: LoraSpec | None) -> NamedConfig:
  """``named`` with its model's adapters set to ``spec`` (None: unchanged)."""
  if spec is None:
    return named
  return dataclasses.replace(named, model=dataclasses.replace(named.model, lora=spec))


def default_config(model: str | None) -> str:
  """The config a run uses when only ``--model`` (or nothing) is given."""
  if model is None:
    return TrainConfig.config
  if model not in DEFAULT_CONFIG:
    raise RunError(f"unknown --model '{model}'; valid: {', '.join(DEFAULT_CONFIG)}")
  return DEFAULT_CONFIG[model]


NUMERICS_FIELDS = ('attention', 'dtype', 'loss_chunk')
# Settings of one invocation, not of the run: never recorded, never read back.
def matching_config(path: str) -> str:
  """The shipped config whose model shape equals that of the Hugging Face checkpoint at ``path``,
  else ``hf:PATH``: the model built from the checkpoint's own config.json.

  Raises:
    HFImportError: one line, for a folder or config.json that cannot be used.
  """
  from models.hf.load import load_hf_config
  arch, hf_cfg = load_hf_config(path)
  for name in config_names(arch):
    ours = load_config(name).model
    # A ResNet's image_size is only its default training side, not part of its shape; nor
    # are the fields that only change how the model computes.
    same = {f: getattr(ours, f) for f in NUMERICS_FIELDS + ('image_size',)
            if hasattr(ours, f) and (f != 'image_size' or arch == 'resnet')}
    if ours == dataclasses.replace(hf_cfg, **same):
      return name
  return HF_CONFIG_PREFIX + str(path)
