"""``pareprop train``: a thin front end over :func:`pareprop.trainer.train`.

Options come from three layers, later ones winning: the defaults of
:class:`pareprop.trainer.TrainConfig`, a ``--config`` file (YAML or JSON, keys are the field
names), and the flags actually given on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from pareprop.checkpoint import CheckpointError
from pareprop.cli.options import Parser
from pareprop.convert import converted_model_name
from pareprop.data import DatasetNotFoundError, MissingPackageError
from pareprop.trainer import (
    AMP_MODES,
    DETECTION_DEFAULTS,
    PRESETS,
    TASKS,
    NonFiniteLossError,
    TrainConfig,
    TrainingInterrupted,
    train,
)

__all__ = ["main", "build_parser", "resolve_config"]


def build_parser() -> argparse.ArgumentParser:
    # SUPPRESS: a flag that is not given leaves no attribute, so it cannot override the
    # config file with a default.
    # argparse %-formats the options' help, not the description: "95%" here, "95%%" in a help.
    p = Parser(
        prog="pareprop train",
        description="Train a reversible model. Defaults train rev_vit_tiny_patch4_32 on the "
        "built-in digits (offline) to >= 95% validation accuracy in a few CPU minutes.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file of options; flags override it")
    d, group = TrainConfig(), p.add_argument_group  # --help reads in these sections
    _model_options(group("model", "the model and its starting weights"), d)
    _convert_options(group("fine-tuning a converted model", "a pretrained model converted to "
                           "a reversible coupling (pareprop.convert)"), d)
    _engine_options(group("engine and memory", "how backward runs and what it keeps"), d)
    _data_options(group("data"), d)
    _optimizer_options(group("optimization"), d)
    _run_options(group("the run", "its directory, resuming, stopping, the device and what it "
                       "reports"), d)
    return p


def _model_options(g: Any, d: TrainConfig) -> None:
    g.add_argument("--task", help="classification, or detection: a detector (--model "
                   "ARCH:BACKBONE, default maskrcnn:rev_mvitv2_tiny) on COCO-format data "
                   "(--dataset DIR, default the built-in shapes), validated by COCO AP "
                   "(default classification; docs/detection.md)")
    g.add_argument("--model", help=f"registered model name (default {d.model})")
    g.add_argument(
        "--model-arg",
        dest="model_args",
        action="append",
        metavar="KEY=VALUE",
        help="override a model config field, e.g. --model-arg depth=6 (repeatable; values "
        "are parsed as YAML)",
    )
    g.add_argument("--num-classes", type=int, help="classes of the model's head (with "
                   "--pretrained: a fresh head when they differ from the weights')")
    g.add_argument("--pretrained", action=argparse.BooleanOptionalAction,
                   help="start from the model's published weights (pareprop.trainer.finetune)")
    g.add_argument("--pretrained-file", help="start from the weights in this file: published "
                   "layouts (PySlowFast, mmpretrain), .safetensors or a pareprop checkpoint; "
                   "with --convert-from, a local copy of the timm weights (read with "
                   "weights_only=True)")


def _convert_options(g: Any, d: TrainConfig) -> None:
    g.add_argument("--convert-from", help="fine-tune this pretrained model converted to a "
                   "reversible coupling (pareprop.convert): timm's vit_*, deit*, swin_*, "
                   "swinv2_*, mvitv2_*, torchvision's swin_t/s/b, swin_v2_t/s/b, mvit_v1_b, "
                   "mvit_v2_s, swin3d_t/s/b; from "
                   "its library's pretrained weights; offline, give them as --pretrained-file")
    g.add_argument("--from-scratch", action=argparse.BooleanOptionalAction,
                   help="with --convert-from: random initial weights instead of timm's "
                   "pretrained ones (off: timm's weights, downloaded, or --pretrained-file)")
    g.add_argument("--coupling-schedule", choices=("linear", "cosine", "reversible"),
                   help="from the pretrained network (1, 0) to the reversible coupling (0, 1) "
                   "(cosine); reversible: (0, 1) from the first step")
    g.add_argument("--coupling-steps", type=int, help="optimizer steps the schedule takes "
                   "(default: one epoch)")


def _engine_options(g: Any, d: TrainConfig) -> None:
    g.add_argument("--engine", help=f"autograd, reversible or pareprop (default {d.engine})")
    g.add_argument(
        "--memory-budget",
        help="activation memory for the reversible engines: bytes (12GiB, 8e9) or a fraction "
        "from 0 (every block recomputed) to 1 (every block stored); the blocks that save the "
        "most time per byte are stored (pareprop.set_memory_budget)",
    )
    g.add_argument(
        "--grad-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="run the blocks that are not reversible (MViTv2 transitions, Swin merging and "
        "fusion) under activation checkpointing: less memory, one more forward of them (off)",
    )
    g.add_argument(
        "--chunk-bytes",
        help="reversible engines: rebuild and differentiate each block's branches in chunks "
        "whose graphs save at most this many bytes (256MiB, 1GiB; pareprop.set_chunking): "
        "less memory, about the same time; pareprop plan --chunk-bytes auto suggests one "
        "(default: whole branches)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile every block's F and G, used in forward and recomputation by every "
        "engine (pareprop.compile_blocks; off)",
    )
    g.add_argument("--amp", choices=AMP_MODES, help="autocast: none, bf16 (CPU/GPU), fp16 (GPU)")
    g.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        help="under torchrun, shard parameters, gradients and optimizer state over the "
        "processes with FSDP2 (one unit per block) instead of replicating them with DDP (off)",
    )


def _data_options(g: Any, d: TrainConfig) -> None:
    g.add_argument(
        "--dataset", help="digits, cifar10, cifar100, a path to an image folder, or for a video "
        "model a folder with train/ and val/ splits of videos (default digits)"
    )
    g.add_argument("--data-dir", help=f"where CIFAR lives or is downloaded (default {d.data_dir})")
    g.add_argument("--download", action=argparse.BooleanOptionalAction, help="fetch CIFAR")
    g.add_argument(
        "--augment", action=argparse.BooleanOptionalAction, help="training augmentation (on)"
    )
    g.add_argument("--workers", type=int, help="data loader processes (default 0)")


def _optimizer_options(g: Any, d: TrainConfig) -> None:
    g.add_argument("--epochs", type=int, help=f"(default {d.epochs})")
    g.add_argument(
        "--batch-size", type=int, help=f"global samples per optimizer step (default {d.batch_size})"
    )
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    g.add_argument(
        "--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay})"
    )
    g.add_argument("--layer-decay", type=float, help="layer-wise learning-rate decay, e.g. "
                   "0.75 (timm's create_optimizer_v2; default none)")
    g.add_argument(
        "--warmup-epochs", type=float, help=f"linear warm-up length (default {d.warmup_epochs})"
    )
    g.add_argument("--label-smoothing", type=float, help=f"(default {d.label_smoothing})")
    g.add_argument(
        "--clip-grad", type=float, help=f"max gradient norm, 0 for none (default {d.clip_grad})"
    )
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--seed", type=int, help=f"(default {d.seed})")


def _run_options(g: Any, d: TrainConfig) -> None:
    g.add_argument("--out", help=f"run directory: checkpoints, metrics.jsonl (default {d.out})")
    g.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        help="let a new run use an --out that holds a previous run, deleting that run's "
        "checkpoints, links and metrics (off: such an --out is refused)",
    )
    g.add_argument(
        "--resume",
        help="continue a run: its directory (OUT) or OUT/last; the run's own options are "
        "restored, and --epochs, --stop-after-epochs, --max-steps, --engine, the device and "
        "the like may change (docs/training.md)",
    )
    g.add_argument(
        "--eval-only",
        action=argparse.BooleanOptionalAction,
        help="evaluate the --resume checkpoint and exit",
    )
    g.add_argument(
        "--stop-after-epochs",
        type=int,
        help="stop after this many epochs of this invocation (resume later with --resume)",
    )
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in total")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto)")
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar per epoch (on)"
    )
    g.add_argument("--log-interval", type=int, help="optimizer steps between reads of the "
                   f"running loss from the device (default {d.log_interval})")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="write loss, accuracy, learning rate, samples/s and peak memory for "
                   "TensorBoard into OUT/tensorboard (needs the tensorboard package; off)")


def _load_file(path: str) -> Dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist (or is not a file)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise ValueError(f"cannot read config file {path!r} as {kind}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of options in {path!r}, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _parse_model_args(items: List[str]) -> Dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected --model-arg KEY=VALUE, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(
                f"cannot read --model-arg {item!r}: its value is not YAML ({problem}); e.g. "
                "depth=6, embed_dim=384, drop_path_rate=0.1, img_size=[224,224]"
            ) from None
    return out


def resolve_config(argv: Sequence[str]) -> TrainConfig:
    """Parse ``argv`` on top of ``--config`` on top of the defaults."""
    return resolve_options(argv)[0]


def resolve_options(argv: Sequence[str]) -> Tuple[TrainConfig, Set[str]]:
    """The configuration of ``argv`` and the names of the options it (or its file) sets."""
    ns = vars(build_parser().parse_args(list(argv)))
    values: Dict[str, Any] = {}
    if "config" in ns:
        values.update(_load_file(ns.pop("config")))
    model_args = _parse_model_args(ns.pop("model_args", []))
    if "num_classes" in ns:
        model_args["num_classes"] = ns.pop("num_classes")
    values.update(ns)
    explicit = set(values)
    task = values.get("task", "classification")
    if task not in TASKS:
        raise ValueError(f"expected --task one of {', '.join(TASKS)}, got {task!r}")
    if task == "detection":
        # A detection run starts from its own defaults (model, data, schedule); what the
        # file and the flags give still wins.
        values = {**DETECTION_DEFAULTS, **values}
    converted = converted_model_name(values["convert_from"]) if values.get("convert_from") \
        else None
    if converted and values.get("model") not in (None, converted):
        raise ValueError(
            f"--model {values['model']} and --convert-from {values['convert_from']} name two "
            f"models: --convert-from builds {converted}; give one"
        )
    if model_args:
        # --model-arg changes fields of the model that would otherwise be built: the file's
        # model_kwargs, else the preset for (model, dataset); it does not discard the rest.
        base = values.get("model_kwargs")
        if base is None:
            d = TrainConfig()
            model = converted or values.get("model", d.model)  # detection: filled in above
            key = (model, values.get("dataset", d.dataset))
            base = PRESETS.get(key, {})
        if not isinstance(base, dict):
            raise ValueError(f"expected model_kwargs to be a mapping, got {base!r}")
        values["model_kwargs"] = {**base, **model_args}
    # The task's defaults are not options given: a resumed run keeps its own.
    given = set(values) - (set(DETECTION_DEFAULTS) - explicit)
    return TrainConfig.from_dict(values), given


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, given = resolve_options(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    except (ValueError, TypeError) as e:
        print(f"pareprop train: error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg, given)
    except TrainingInterrupted as e:
        print(f"pareprop train: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("pareprop train: interrupted before training started", file=sys.stderr)
        return 130
    except NonFiniteLossError as e:
        print(f"pareprop train: stopped: {e}", file=sys.stderr)
        return 1
    except (CheckpointError, DatasetNotFoundError, MissingPackageError) as e:
        print(f"pareprop train: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"pareprop train: error: {e}", file=sys.stderr)
        return 2
    return 0
