"""``pareprop eval``: top-1/top-5 accuracy of a model on an image folder (ImageNet's validation
layout), with the published weights, a local weight file or a pareprop checkpoint.

Examples::

    pareprop eval --model rev_vit_base_patch16_224 --pretrained --data-dir imagenet/val
    pareprop eval --model rev_mvit_base --checkpoint REV_MVIT_B.pyth --data-dir imagenet/val \\
        --engine pareprop --amp bf16 --json result.json
    pareprop eval --checkpoint runs/finetune/best --data-dir flowers/val
    pareprop eval --model rev_mvit_base_16x4 --pretrained --data-dir kinetics400/val --amp bf16
    pareprop eval --model converted:swin_tiny_patch4_window7_224 --pretrained \
        --data-dir imagenet/val
    pareprop eval --checkpoint runs/detection/best          # a detector: COCO AP on its run's data
    pareprop eval --checkpoint runs/detection/best --data-dir coco   # or on a COCO-layout folder
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch

import pareprop
from pareprop.catalog import converted_source
from pareprop.checkpoint import META, CheckpointError, is_detector_spec, load_checkpoint
from pareprop.cli.options import Parser, device, existing_path
from pareprop.cli.train import _parse_model_args
from pareprop.convert import converted_model_name
from pareprop.convert.timm_pretrained import load_timm_pretrained
from pareprop.data import MissingPackageError, is_video_model
from pareprop.engine import ENGINES
from pareprop.evaluate import evaluate
from pareprop.evaluate_detection import (
    detector_of_checkpoint,
    evaluate_detector,
    is_detection_config,
)
from pareprop.models.published import PretrainedError, read_state

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pareprop eval",
        description="Top-1/top-5 accuracy on an ImageFolder with the model's own evaluation "
        "transform (timm's resolve_data_config and create_transform).",
    )
    p.add_argument("--model", metavar="NAME", help="registered model name, or converted:SOURCE "
                   "(timm's or torchvision's SOURCE converted by pareprop.convert, at coupling "
                   "(1, 0), with SOURCE's weights); not needed with a pareprop checkpoint, which "
                   "names its model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pretrained", action="store_true",
                     help="the publisher's weights (downloaded through timm; offline, use "
                     "--checkpoint with a local copy)")
    src.add_argument("--checkpoint", metavar="PATH", type=existing_path,
                     help="a PySlowFast or mmpretrain weight file, a .safetensors file, or a "
                     "pareprop checkpoint directory")
    p.add_argument("--data-dir", metavar="DIR",
                   help="one sub-folder of images per class; for a video model, one sub-folder "
                   "of videos per class or a CSV of path,label rows (top-1/top-5 over 5 clips x "
                   "1 crop per video, averaged); for a detector's checkpoint, COCO-format data "
                   "(annotations/instances_val*.json and its images: COCO AP), by default the "
                   "validation data of its run")
    p.add_argument("--model-arg", dest="model_args", action="append", default=[],
                   metavar="KEY=VALUE", help="override a model config field (repeatable)")
    p.add_argument("--engine", choices=ENGINES, help="switch the reversible stacks first")
    p.add_argument("--amp", choices=("none", "bf16"),
                   help="autocast (default none; a detector's checkpoint: its run's)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images (or videos, of 5 clips each) per forward; default 64 images "
                   "or 4 videos")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", type=device,
                   help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--limit", type=int, help="evaluate only the first N images")
    p.add_argument("--json", metavar="PATH", help="also write the result here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_options(args: argparse.Namespace) -> None:
    for name in ("limit", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"expected --{name.replace('_', '-')} >= 1, got {value}")
    if args.workers < 0:
        raise ValueError(f"expected --workers >= 0, got {args.workers}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            raise ValueError(
                f"--json {args.json}: the folder {folder!r} does not exist; create it (checked "
                "before evaluating, so no result is lost)"
            )


def _is_pareprop_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, META)) or os.path.exists(os.path.join(path, "last"))
    )


def build_model(args: argparse.Namespace):
    """The model ``args`` describe, with its weights."""
    kwargs = _parse_model_args(args.model_args)
    if args.engine is not None and kwargs.get("engine", args.engine) != args.engine:
        # evaluate() switches the stacks to --engine: the model argument would be overridden
        raise ValueError(f"--model-arg engine={kwargs['engine']} and --engine {args.engine} "
                         "contradict each other: give one")
    if args.checkpoint and _is_pareprop_checkpoint(args.checkpoint):
        model = pareprop.load_model(args.checkpoint, **kwargs)
        if args.model:
            _check_named_model(args.model, args.checkpoint, model)
        return model
    if not args.model:
        raise ValueError("--model NAME is needed unless --checkpoint is a pareprop checkpoint")
    source = converted_source(args.model)
    if source is not None:
        return build_converted(args.model, source, args.checkpoint, kwargs)
    if args.pretrained:
        return pareprop.create_model(args.model, pretrained=True, **kwargs)
    model = pareprop.create_model(args.model, **kwargs)
    report = pareprop.load_pretrained(model, args.checkpoint)
    if report.dropped_head and "num_classes" in kwargs:
        _refuse_other_head(args.checkpoint, kwargs["num_classes"], report.file_classes)
    return model


# NOTE [ Scoring the file's head ]
# A weight file's classifier of another class count is left out when a model is fine-tuned
# from it (the model keeps a fresh head). Evaluating, a fresh head is random: its accuracy is
# noise, another on every call. So eval refuses --model-arg num_classes that is not the file's.


def _refuse_other_head(path: str, asked: int, file_classes: Optional[int]) -> None:
    theirs = f"{file_classes} classes" if file_classes is not None else "another class count"
    raise ValueError(
        f"--model-arg num_classes={asked}: {path} has a classifier of {theirs}, and eval "
        "scores the file's own head (another would be random); drop --model-arg num_classes"
    )


def _file_classes(model: torch.nn.Module, path: str) -> Optional[int]:
    """The class count of the classifier in the weight file at ``path`` when it is not
    ``model``'s: a 2-D weight of ``model``'s head shape, (classes, features), whose rows
    differ. None when the file's head fits (or the file has none)."""
    state = read_state(path)
    for key, own in model.state_dict().items():
        theirs = state.get(key)
        if (theirs is not None and own.dim() == 2 and theirs.dim() == 2
                and own.shape[0] == model.num_classes and theirs.shape[1] == own.shape[1]
                and theirs.shape[0] != own.shape[0]):
            return int(theirs.shape[0])
    return None


def _check_named_model(asked: str, path: str, model: torch.nn.Module) -> None:
    """Refuse a ``--model`` that is not the model the checkpoint at ``path`` names."""
    name = getattr(model, "model_name", None)
    source = (getattr(model, "model_kwargs", None) or {}).get("source")
    wanted = converted_source(asked)
    same = (source == wanted and name == converted_model_name(wanted, asked)) \
        if wanted is not None else asked == name
    if not same:
        theirs = f"{name} of {source}" if source is not None else name
        raise ValueError(
            f"--model {asked} and --checkpoint {path} ({theirs}) name two models: drop --model "
            "(a pareprop checkpoint names its model)"
        )


def build_converted(name: str, source: str, weight_file: Optional[str], kwargs: dict):
    """``converted:SOURCE``: SOURCE built by its library's name and converted, at (1, 0), where
    its logits are the source's to the bit; with SOURCE's weights, from ``weight_file`` in its
    publisher's layout (read through the family's own filter) or, without one, its library's
    download (``--pretrained``), as ``pareprop train --convert-from`` starts from them."""
    model_name = converted_model_name(source, name)  # raises, naming the families converted
    if weight_file is not None:
        model = pareprop.create_model(model_name, source=source, pretrained_file=weight_file,
                                      **kwargs)
        if "num_classes" in kwargs:  # NOTE [ Scoring the file's head ]
            file_classes = _file_classes(model, weight_file)
            if file_classes is not None:
                _refuse_other_head(weight_file, kwargs["num_classes"], file_classes)
        return model
    model = pareprop.create_model(model_name, source=source, **kwargs)
    try:
        load_timm_pretrained(model, source)
    except PretrainedError as e:
        # The loaders word their advice for pareprop train (--pretrained-file, --from-scratch):
        # keep their reason, give eval's.
        text = str(e).removeprefix(f"--convert-from {source}: ")  # train's flag, not eval's
        if "; drop " in text:  # model arguments the weights do not fit: name them, no flags
            reason = text.split(", or pass weights")[0]
            raise PretrainedError(f"--model {name} --pretrained: {reason}, or pass weights of "
                                  "this configuration with --checkpoint PATH") from None
        reason = text.split("; offline")[0].split("; pass ")[0]
        raise PretrainedError(f"--model {name} --pretrained: {reason}; offline, pass a local "
                              f"copy of {source}'s weights with --checkpoint PATH") from None
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    try:
        # Checked before the model is built and the folder read: nothing is lost to a typo.
        _check_options(args)
        detection = _detection_checkpoint(args)
        if detection is not None:
            return _report(_evaluate_detector(args, detection), args)
        if args.data_dir is None:
            raise ValueError("--data-dir DIR is needed (a folder of class folders), except for "
                             "a detector's checkpoint, which names its run's data")
        model = build_model(args)
        result = evaluate(
            model,
            args.data_dir,
            batch_size=args.batch_size or (4 if is_video_model(model) else 64),
            workers=args.workers,
            engine=args.engine,
            amp=args.amp or "none",
            device=None if args.device is None else torch.device(args.device),
            progress=not args.no_progress,
            limit=args.limit,
        )
    except (ValueError, CheckpointError, FileNotFoundError, MissingPackageError) as e:
        print(f"pareprop eval: error: {e}", file=sys.stderr)
        return 2
    result = {"model": getattr(model, "model_name", args.model),
              "weights": args.checkpoint or "pretrained", **result}
    return _report(result, args)


def _detection_checkpoint(args: argparse.Namespace):
    """The loaded checkpoint when ``--checkpoint`` is a detector's, else None."""
    if not (args.checkpoint and _is_pareprop_checkpoint(args.checkpoint)):
        return None
    ckpt = load_checkpoint(args.checkpoint, train_state=False)
    return ckpt if is_detector_spec(ckpt.meta.get("model")) else None


def _evaluate_detector(args: argparse.Namespace, ckpt) -> dict:
    """COCO AP of a detector's checkpoint on its run's validation data (or ``--data-dir``):
    the numbers its run logged (NOTE [ The same AP in training and evaluation ] in
    pareprop/evaluate_detection.py)."""
    overrides = _parse_model_args(args.model_args)
    if args.engine is not None:
        overrides["engine"] = args.engine
    if args.limit is not None:
        raise ValueError("--limit is for classifiers; a detector is evaluated on the whole "
                         "validation set (COCO AP)")
    config = ckpt.meta.get("data_config")
    if not is_detection_config(config):
        raise CheckpointError(f"{ckpt.path!r} holds a detector but no detection data config")
    run_amp = (ckpt.meta.get("config") or {}).get("amp")
    amp = args.amp or ("bf16" if run_amp == "bf16" else "none")  # as its run validated
    model = detector_of_checkpoint(ckpt, **overrides)
    result = evaluate_detector(
        model, config, data_dir=args.data_dir, amp=amp, workers=args.workers,
        batch_size=args.batch_size,
        device=None if args.device is None else torch.device(args.device),
    )
    return {"model": ckpt.meta["model"]["name"], "weights": ckpt.path, "epoch": ckpt.epoch,
            **result}


def _report(result: dict, args: argparse.Namespace) -> int:
    """Print ``result`` as JSON and, with --json, write it there."""
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:  # the result is printed above: not lost
            print(f"pareprop eval: error: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 2
    return 0
