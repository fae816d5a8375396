"""Every choice of a training run: :class:`TrainConfig`, its checks and the presets.

The CLI (flags and a ``--config`` file), a resumed run's saved options and the tests all fill a
:class:`TrainConfig`; :meth:`TrainConfig.from_dict` checks a file's values against the fields'
types, and ``__post_init__`` refuses a bad value before anything runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from pareprop.devices import check_device_name
from pareprop.engine.chunk_cost import parse_chunking
from pareprop.memory.budget import parse_budget
from pareprop.memory.step import AMP_MODES
from pareprop.trainer.finetune import apply_convert_options

# What a run learns: classification (an image, video or text classifier) or detection (a
# torchvision detector on COCO-format data; pareprop.trainer.detection).
TASKS = ("classification", "detection")
# The data sets that are classification data: a detection run refuses them by name.
CLASSIFICATION_DATASETS = ("digits", "cifar10", "cifar100")
# Seeds from 0 to 2**32 - 1: numpy's range, and each epoch's seed (seed + 7919 * epoch + rank)
# stays within the 64 bits torch.manual_seed takes.
MAX_SEED = 2**32 - 1
MISSING_TENSORBOARD = (
    "--tensorboard needs the tensorboard package, which is not installed: pip install "
    "tensorboard (or pareprop[tensorboard]), or drop --tensorboard"
)
# Model settings used when a run names no model kwargs. The default model at digits scale:
# 8x8 grey input, 2x2 patches (16 tokens), width 64, 4 reversible blocks (0.2M parameters) reaches
# >= 95% validation accuracy in a few minutes on a 2-core CPU (docs/training.md has the command).
PRESETS: Dict[Tuple[str, str], Dict[str, Any]] = {
    ("rev_vit_tiny_patch4_32", "digits"): dict(
        img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=4, num_heads=4
    ),
    # The default detector at shapes scale (pareprop.trainer.detection): a narrow, shallow
    # Rev-MViTv2 over 128x128 images, a 64-channel pyramid and small RPN/RoI samples, so that
    # ``pareprop train --task detection`` reaches box AP50 >= 0.5 on a 2-core CPU in about
    # ten minutes (BENCHMARKS.md, "Detection").
    ("maskrcnn:rev_mvitv2_tiny", "shapes"): dict(
        backbone_args=dict(embed_dim=32, depth=4, last_block_indexes=[0, 1, 2, 3],
                           window_size=8, kv_stride=2, img_size=128),
        fpn_channels=64, heads="small", min_size=128, max_size=128,
        rpn_batch_size_per_image=64, box_batch_size_per_image=64,
        rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=100,
        rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=100, box_detections_per_img=20,
    ),
}
# A detection run's defaults where they differ from a classification run's: the options
# ``pareprop train --task detection`` starts from (the CLI fills them in; see
# :meth:`TrainConfig.for_task`). Chosen for the default run on the shapes (BENCHMARKS.md).
DETECTION_DEFAULTS: Dict[str, Any] = dict(
    model="maskrcnn:rev_mvitv2_tiny",
    dataset="shapes",
    # The shapes are learnt fastest at their own scale; large-scale jitter (--augment) is
    # for real data.
    augment=False,
    epochs=3,
    batch_size=8,
    lr=1e-3,
    weight_decay=0.05,
    warmup_epochs=1.0,
    label_smoothing=0.0,
    out="runs/detection",
)


@dataclass
class TrainConfig:
    """Everything a training run depends on; defaults train the digits model in minutes."""

    # classification or detection (TASKS); a detection run's defaults: DETECTION_DEFAULTS.
    task: str = "classification"
    model: str = "rev_vit_tiny_patch4_32"
    model_kwargs: Optional[Dict[str, Any]] = None  # None: PRESETS[(model, dataset)] or {}
    engine: str = "reversible"
    # Activation memory for the reversible engines: bytes ("12GiB") or a fraction 0..1 between
    # every block recomputed and every block stored (pareprop.set_memory_budget).
    memory_budget: Optional[Union[str, float]] = None
    # Compile every block's F and G with torch.compile (pareprop.compile_blocks).
    compile: bool = False
    # Run the blocks that are not reversible (MViTv2 transitions, Swin merging and fusion)
    # under activation checkpointing (model.set_grad_checkpointing()).
    grad_checkpointing: bool = False
    # Rebuild and differentiate the reversible blocks' branches in chunks whose graphs save at
    # most this many bytes ("256MiB"; pareprop.set_chunking); None: whole branches.
    chunk_bytes: Optional[Union[str, int]] = None
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    augment: bool = True
    epochs: int = 40
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    clip_grad: Optional[float] = 1.0
    grad_accum: int = 1
    amp: str = "none"
    seed: int = 0
    out: str = "runs/train"
    # A new run refuses an --out that holds anything; this deletes the previous run's files.
    overwrite: bool = False
    resume: Optional[str] = None
    eval_only: bool = False
    workers: int = 0
    device: str = "auto"
    stop_after_epochs: Optional[int] = None
    max_steps: Optional[int] = None
    progress: bool = True
    # Optimizer steps between the host's reads of the running loss (the progress bar, the
    # TensorBoard scalars, the non-finite check): NOTE [ Reading the device once per log
    # interval ] in trainer/loop.py.
    log_interval: int = 10
    # Write the run's scalars for TensorBoard into OUT/tensorboard (torch.utils.tensorboard).
    tensorboard: bool = False
    # Under torchrun: shard parameters, gradients and optimizer state with FSDP2
    # (pareprop.distributed.shard) instead of replicating them with DDP.
    fsdp: bool = False
    # Fine-tuning (pareprop.trainer.finetune). From published weights: pretrained (the model's
    # published file) or pretrained_file (a local one), with a fresh head when the class counts
    # differ. From a timm ViT converted to a reversible coupling: convert_from, from timm's
    # pretrained weights (its download) or pretrained_file (a local copy of them). layer_decay
    # scales block i's learning rate by layer_decay ** (L - i) (timm's optimizer factory).
    pretrained: bool = False
    layer_decay: Optional[float] = None
    convert_from: Optional[str] = None
    pretrained_file: Optional[str] = None
    # With convert_from: start from random weights instead of timm's pretrained ones.
    from_scratch: bool = False
    coupling_schedule: str = "cosine"
    coupling_steps: Optional[int] = None  # None: one epoch

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"expected --task one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "detection":
            _check_detection(self)
        apply_convert_options(self)
        if self.amp not in AMP_MODES:
            raise ValueError(f"expected --amp one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        for name in ("epochs", "batch_size", "grad_accum", "log_interval"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "stop_after_epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"expected {name} >= 1 (or unset), got {value}")
        if self.fsdp and self.amp == "fp16":
            raise ValueError(
                "--fsdp with --amp fp16 is not supported: the fp16 gradient scaler is not "
                "checked against sharded gradients; use --amp bf16 (it needs no scaler)"
            )
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)  # refuse a bad budget before anything runs
        if self.chunk_bytes is not None and str(self.chunk_bytes).strip().lower() == "auto":
            raise ValueError(
                "--chunk-bytes auto is a planning choice: run pareprop plan --chunk-bytes auto "
                "and give train the chunk size it reports (e.g. --chunk-bytes 256MiB)"
            )
        # Parsed once, here (NOTE [ Chunk sizes are parsed at the edge ] in engine/stack.py):
        # the run's setup takes ``chunking``; ``chunk_bytes`` stays as given, the saved form.
        self.chunking = parse_chunking(max_bytes=self.chunk_bytes)  # a bad size is refused
        if self.chunking is not None and self.engine == "autograd" and self.resume is None:
            raise ValueError(
                f"--chunk-bytes {self.chunk_bytes} chunks the recomputation of the "
                f"reversible engines, and --engine {self.engine} recomputes nothing: use "
                "--engine reversible or pareprop, or drop --chunk-bytes"
            )
        if self.workers < 0:
            raise ValueError(f"expected workers >= 0, got {self.workers}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"expected --seed from 0 to {MAX_SEED} (2**32 - 1), got {self.seed}")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(MISSING_TENSORBOARD)
        # The device's form here; whether this machine has it, when the run sets up.
        check_device_name(self.device, auto=True)
        if self.model_kwargs is None:
            self.model_kwargs = dict(PRESETS.get((self.model, self.dataset), {}))
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"expected a positive learning rate, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"expected weight_decay >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ValueError(f"expected warmup_epochs >= 0, got {self.warmup_epochs}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"expected label_smoothing in [0, 1], got {self.label_smoothing}")
        if self.clip_grad == 0:
            self.clip_grad = None  # documented: 0 disables clipping
        if self.clip_grad is not None and not (
            math.isfinite(self.clip_grad) and self.clip_grad > 0
        ):
            raise ValueError(f"expected clip_grad > 0 (or 0 for none), got {self.clip_grad}")

    @classmethod
    def for_task(cls, task: str, **options: Any) -> TrainConfig:
        """A config of ``task`` with that task's defaults (DETECTION_DEFAULTS for detection),
        ``options`` overriding them."""
        defaults = DETECTION_DEFAULTS if task == "detection" else {}
        return cls(task=task, **{**defaults, **options})

    @classmethod
    def fields(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> TrainConfig:
        """Build from a mapping (a config file), checking each value against its field's type.

        YAML gives strings for some numbers (``1e-3`` without a dot) and a file may say
        ``augment: "false"``; both must not slip through as a string.
        """
        unknown = sorted(set(d) - set(cls.fields()))
        if unknown:
            raise ValueError(
                f"unknown training option(s) {', '.join(unknown)}; valid: {', '.join(cls.fields())}"
            )
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        return cls(**{k: _coerce(k, v, types[k]) for k, v in d.items()})


def _check_detection(cfg: TrainConfig) -> None:
    """Refuse, in one line each, what a detection run cannot take."""
    if cfg.dataset in CLASSIFICATION_DATASETS:
        raise ValueError(
            f"--task detection trains on COCO-format data (the built-in shapes, or a folder "
            f"with annotations/instances_train.json), got the classification data set "
            f"{cfg.dataset!r}: pass --dataset shapes or --dataset DIR, or drop --task detection"
        )
    if ":" not in cfg.model:
        raise ValueError(
            f"--task detection trains a detector named ARCH:BACKBONE (e.g. "
            f"{DETECTION_DEFAULTS['model']}), got the classifier {cfg.model!r}"
        )
    for name, what in (("convert_from", "--convert-from"), ("layer_decay", "--layer-decay"),
                       ("memory_budget", "--memory-budget"), ("pretrained", "--pretrained")):
        if getattr(cfg, name):
            raise ValueError(f"{what} is for classification runs; a detector's backbone "
                             f"options go in --model-arg (backbone_args=..., pretrained_file=...)")
    if cfg.fsdp:
        raise ValueError("--fsdp is for classification runs; train a detector with DDP "
                         "(torchrun without --fsdp)")


def _coerce(name: str, value: Any, type_name: str) -> Any:
    """``value`` as the type named ``type_name`` (``int``, ``Optional[float]``, ...)."""
    optional = type_name.startswith("Optional[")
    base = type_name[len("Optional[") : -1] if optional else type_name
    if value is None:
        if optional:
            return None
        raise ValueError(f"expected a value for {name}, got null")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected {name} true or false, got {value!r}")
    if base in ("int", "float"):
        if base == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value  # as it is: through a float, 99999999999999999999 would be 1e20
        if not isinstance(value, bool):
            try:
                number = float(value)
                if base == "float":
                    return number
                if number.is_integer():
                    return int(number)
            except (TypeError, ValueError):
                pass
        kind = "an integer" if base == "int" else "a number"
        raise ValueError(f"expected {name} to be {kind}, got {value!r}")
    if base == "str":
        if isinstance(value, str):
            return value
        raise ValueError(f"expected {name} to be a string, got {value!r}")
    if base.startswith("Dict") and not isinstance(value, dict):
        raise ValueError(f"expected {name} to be a mapping (KEY: VALUE, ...), got {value!r}")
    return value
