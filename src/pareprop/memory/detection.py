"""The memory of a detector's training step: planned on fake tensors, or measured on real ones,
with the peak split into the backbone, its pyramid and the heads.

Detectors are named ``ARCH:BACKBONE`` (``maskrcnn:rev_mvitv2_tiny``,
``maskrcnn:detectron2:vitdet_b``); :func:`pareprop.plan_memory` and
:func:`pareprop.largest_batch` hand such names here. Engines:

* ``reversible``, ``pareprop``: the backbone's stacks under that engine (a detectron2 backbone
  at the coupling (0, 1), where every block is rebuilt; any beta > 0 plans the same);
* ``plain``: the architecture unconverted: the stacks under autograd (a detectron2 backbone at
  the coupling (1, 0), its ordinary residual blocks);
* ``checkpointed``: ``plain`` with every block under activation checkpointing, as detectron2's
  ``use_act_checkpoint``.

The data-dependent parts of the step take the worst case the detector's configuration allows
(NOTE [ Planning a detector's worst case ] in ``worst_case.py``).

NOTE [ The peak split of a detector ]
    Every storage is counted in one part: parameters, their gradients and optimizer state by
    the module that owns the parameter (the backbone's trunk, its pyramid, or the heads:
    transform, RPN and RoI heads); everything else by the phase of the step that made it. In
    forward the phases follow the modules (the transform's batch is ``inputs``, with the
    images and targets); in backward a phase starts when the gradient of its outputs arrives
    (a hook on the pyramid's maps starts ``pyramid``, one on the trunk's features
    ``backbone``); the optimizer's temporaries are ``optimizer``. ``split`` holds the parts
    alive at the peak and sums to it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from pareprop.engine import set_chunking
from pareprop.engine.chunk_cost import Chunking, tracing_distinct_chunks
from pareprop.engine.stack import REVERSIBLE_ENGINES
from pareprop.memory.fake_modes import cpu_linspace, planning_values
from pareprop.memory.measure import StepPeakTracker, apply_engine
from pareprop.memory.report import MemoryReport
from pareprop.memory.step import (
    _SavedBytes,
    _StreamBytes,
    amp_dtype,
    amp_label,
    create_optimizer_state,
    finish_counts,
    make_optimizer,
    unique_bytes,
)
from pareprop.memory.units import parse_memory
from pareprop.memory.worst_case import worst_case_sampling

__all__ = [
    "DETECTOR_ENGINES",
    "DetectorFactory",
    "register_detector_factory",
    "SPLIT_PARTS",
    "build_detector",
    "detector_memory_report",
    "is_detector_name",
    "plan_detector",
    "synthetic_targets",
]

DETECTOR_ENGINES = ("reversible", "pareprop", "plain", "checkpointed")
SPLIT_PARTS = ("inputs", "backbone", "pyramid", "heads", "optimizer")
# Ground-truth instances per image planned by default: COCO averages about 7 an image; the
# masks enter as inputs, and the step converts one image's masks to float at a time.
DEFAULT_GT_PER_IMAGE = 20


# NOTE [ Detectors reach the planner by registration ]
#     pareprop.detection builds on the checkpoint and pretrained-weight modules, which build on
#     this package, so the planner cannot import it. Instead pareprop.detection registers what
#     the planner needs (its architectures, its factory, its name parser and its backbone
#     check) here when it is imported, as detection backbones register their builders by
#     prefix; ``import pareprop`` imports it.


class DetectorFactory(NamedTuple):
    """What the planner asks of pareprop.detection."""

    archs: Tuple[str, ...]  # DETECTOR_ARCHS
    create: Callable[..., nn.Module]  # create_detector
    parse_name: Callable[[str], Tuple[str, str]]  # parse_detector_name
    check_backbone: Callable[[str], Any]  # backbone_builder: refuses an unknown backbone


_FACTORY: List[DetectorFactory] = []


def register_detector_factory(factory: DetectorFactory) -> None:
    """Give the planner pareprop.detection's factory (NOTE [ Detectors reach the planner by
    registration ])."""
    _FACTORY[:] = [factory]


def _factory() -> DetectorFactory:
    if not _FACTORY:
        raise RuntimeError("detectors are planned through pareprop.detection: import pareprop "
                           "(or pareprop.detection) first")
    return _FACTORY[0]


def is_detector_name(name: Any) -> bool:
    """Whether ``name`` is ``ARCH:BACKBONE`` with a known detector ARCH."""
    archs = _FACTORY[0].archs if _FACTORY else ()
    return isinstance(name, str) and name.split(":", 1)[0] in archs and ":" in name


def _trunk(backbone: nn.Module) -> nn.Module:
    # detectron2's pyramids read ``net``/``bottom_up`` (their ``body`` is themselves).
    for attr in ("net", "bottom_up", "body"):
        body = getattr(backbone, attr, None)
        if isinstance(body, nn.Module) and body is not backbone:
            return body
    raise ValueError(f"expected a detection backbone with a trunk (body, net or bottom_up), "
                     f"got {type(backbone).__name__}")


class SplitTracker(StepPeakTracker):
    """:class:`StepPeakTracker` that also counts each storage in a part of the detector and
    keeps the parts alive at the peak (NOTE [ The peak split of a detector ])."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "inputs"
        self.parts: Dict[str, int] = dict.fromkeys(SPLIT_PARTS, 0)
        self.split: Dict[str, int] = dict(self.parts)
        self._part_of: Dict[int, str] = {}

    def track(self, t: torch.Tensor) -> None:
        key = id(t.untyped_storage())
        before = self._sizes.get(key)
        old = before[1] if before is not None else 0
        super().track(t)
        entry = self._sizes.get(key)
        if entry is None:
            return
        part = self._part_of.setdefault(key, self.phase)
        self.parts[part] += entry[1] - old

    def _freed(self, key: int, ref: Any) -> None:
        entry = self._sizes.get(key)
        if entry is not None and entry[0] is ref and key in self._part_of:
            self.parts[self._part_of.pop(key)] -= entry[1]
        super()._freed(key, ref)

    def _count_aside(self) -> None:
        before = set(self._sizes)
        super()._count_aside()
        for key in set(self._sizes) - before:  # what a chunk's measurement left alive
            self._part_of[key] = self.phase
            self.parts[self.phase] += self._sizes[key][1]

    def _new_peak(self) -> None:
        self.split = dict(self.parts)

    def track_owned(self, detector: nn.Module, optimizer: Any) -> None:
        """Count parameters, buffers, gradients and optimizer state by owning part."""
        trunk = _trunk(detector.backbone)
        owner: Dict[int, str] = {}
        for part, module in (("heads", detector), ("pyramid", detector.backbone),
                             ("backbone", trunk)):
            for t in list(module.parameters()) + list(module.buffers()):
                owner[id(t)] = part
        for t in list(detector.parameters()) + list(detector.buffers()):
            self.phase = owner[id(t)]
            self.track(t)
            if t.grad is not None:
                self.track(t.grad)
        if optimizer is not None:
            for p, state in optimizer.state.items():
                self.phase = owner.get(id(p), "optimizer")
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self.track(v)
        self.phase = "inputs"
        self.peak = max(self.peak, self.current)
        self.split = dict(self.parts)


@contextlib.contextmanager
def _phases(detector: nn.Module, tracker: SplitTracker):
    """Move ``tracker.phase`` as the step goes through the detector's parts."""
    backbone = detector.backbone
    trunk = _trunk(backbone)

    def set_phase(name):
        def hook(*_):
            tracker.phase = name
        return hook

    def grad_hooks(tensors: Any, name: str) -> None:
        if isinstance(tensors, dict):
            tensors = list(tensors.values())
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for t in tensors if isinstance(tensors, (list, tuple)) else []:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(set_phase(name))

    def trunk_out(module, args, out):
        grad_hooks(out, "backbone")
        tracker.phase = "pyramid"

    def pyramid_in(module, args):  # a trunk read by forward_intermediates: the pyramid's input
        grad_hooks(args[0], "backbone")
        tracker.phase = "pyramid"

    def backbone_out(module, args, out):
        grad_hooks(out, "pyramid")
        tracker.phase = "heads"

    hooks = [backbone.register_forward_pre_hook(set_phase("backbone")),
             backbone.register_forward_hook(backbone_out)]
    fpn = getattr(backbone, "fpn", None)
    if getattr(backbone, "body", None) is trunk and isinstance(fpn, nn.Module):
        hooks.append(fpn.register_forward_pre_hook(pyramid_in))
    else:
        hooks.append(trunk.register_forward_hook(trunk_out))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def apply_detector_engine(detector: nn.Module, engine: Optional[str],
                          grad_checkpointing: bool = False) -> None:
    """Put a detector's backbone on ``engine`` (:func:`pareprop.memory.measure.apply_engine`);
    under ``checkpointed``, and with ``grad_checkpointing`` under the reversible engines, the
    backbone's blocks that are not reversible (MViT's stage transitions) are checkpointed too,
    as detectron2's ``use_act_checkpoint`` checkpoints every block."""
    apply_engine(detector, engine)
    setter = getattr(detector.backbone, "set_grad_checkpointing", None)
    if setter is not None:
        setter(engine == "checkpointed" or bool(grad_checkpointing))
    elif grad_checkpointing:
        raise ValueError(f"grad_checkpointing needs the backbone's set_grad_checkpointing(); "
                         f"{type(detector.backbone).__name__} has none")


def detector_step(detector: nn.Module, images: List[torch.Tensor], targets: List[dict],
                  optimizer: Any, dtype: Optional[torch.dtype],
                  tracker: Optional[SplitTracker] = None) -> Dict[str, int]:
    """One training step of a torchvision detector (the sum of its losses), counted by
    ``tracker`` (None: not counted); returns the byte counts of
    :func:`pareprop.memory.step.run_step`."""
    params = list(detector.parameters()) + list(detector.buffers())
    given = list(images) + [v for t in targets for v in t.values() if isinstance(v, torch.Tensor)]
    counts = {"parameters": unique_bytes(params), "inputs": unique_bytes(given)}
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        detector.zero_grad(set_to_none=True)
    if tracker is not None:
        tracker.track_owned(detector, optimizer)
        tracker.track_external(given)
    saved = _SavedBytes(params + given)
    autocast = (torch.autocast(images[0].device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    streams = _StreamBytes(detector)
    collecting = gc.isenabled()
    gc.disable()  # NOTE [ A count that does not depend on the collector ] in measure.py
    try:
        counting = (contextlib.nullcontext() if tracker is None
                    else contextlib.ExitStack())
        if tracker is not None:
            counting.enter_context(tracker)
            counting.enter_context(_phases(detector, tracker))
        with counting:
            with saved.hooks(), streams:
                with autocast:
                    losses = detector(images, targets)
                loss = sum(v.float() for v in losses.values())
            counts["activations"] = saved.alive_bytes()
            del losses
            if tracker is not None:
                tracker.phase = "heads"
            loss.backward()
            del loss
            counts["gradients"] = unique_bytes(p.grad for p in detector.parameters())
            if tracker is not None:
                tracker.phase = "optimizer"
            if optimizer is not None:
                optimizer.step()
    finally:
        if collecting:
            gc.enable()
    return finish_counts(counts, optimizer, streams)


def synthetic_targets(num_images: int, image_size: Tuple[int, int], num_classes: int,
                      gt_per_image: int, masks: bool, device: Any = "cpu") -> List[dict]:
    """Targets of ``gt_per_image`` boxes per image, spread over the image (the same every call:
    no random state is used), with full-size uint8 masks when ``masks``."""
    h, w = image_size
    out = []
    for i in range(num_images):
        j = torch.arange(gt_per_image, dtype=torch.float32, device=device)
        side = torch.minimum(torch.tensor(float(min(h, w)) / 3, device=device),
                             8 + (j * 7 + i) % max(min(h, w) // 3, 1))
        x0 = (j * 37 + 11 * i) % max(w - side.max().item() - 1, 1)
        y0 = (j * 53 + 5 * i) % max(h - side.max().item() - 1, 1)
        boxes = torch.stack([x0, y0, x0 + side, y0 + side], dim=1)
        target = {"boxes": boxes,
                  "labels": (torch.arange(gt_per_image, device=device) % (num_classes - 1)) + 1}
        if masks:
            m = torch.zeros(gt_per_image, h, w, dtype=torch.uint8, device=device)
            for k, (a, b, c, d) in enumerate(boxes.round().long().tolist()):
                m[k, b:d, a:c] = 1
            target["masks"] = m
        out.append(target)
    return out


def _parse_image_size(img_size: Any) -> Tuple[int, int]:
    if isinstance(img_size, int) and not isinstance(img_size, bool) and img_size > 0:
        return img_size, img_size
    if isinstance(img_size, str):
        parts = img_size.lower().split("x")
        if len(parts) in (1, 2) and all(p.isdigit() and int(p) > 0 for p in parts):
            return int(parts[0]), int(parts[-1])
    if (isinstance(img_size, (tuple, list)) and len(img_size) == 2
            and all(isinstance(v, int) and v > 0 for v in img_size)):
        return int(img_size[0]), int(img_size[1])
    raise ValueError(f"expected an image size H, HxW or (H, W) of positive ints, got "
                     f"{img_size!r}")


def build_detector(name: str, engine: str, num_classes: int, image_size: Tuple[int, int],
                    detector_kwargs: Dict[str, Any]) -> nn.Module:
    arch, backbone = _factory().parse_name(name)
    if arch == "retinanet":
        raise ValueError(f"planning covers the R-CNN detectors (maskrcnn, fasterrcnn); got "
                         f"{name!r}")
    kwargs = dict(detector_kwargs)
    backbone_args = dict(kwargs.pop("backbone_args", None) or {})
    rev = engine in REVERSIBLE_ENGINES
    if backbone.startswith("detectron2:"):
        # (0, 1): every block rebuilt; (1, 0): detectron2's network, whose blocks are stored.
        backbone_args.setdefault("coupling", (0.0, 1.0) if rev else (1.0, 0.0))
        backbone_args.setdefault("tolerance", None)  # a guard measures real steps
        # detectron2's configurations train these backbones with ViTDet's heads (convs with
        # a norm in the box and mask heads, a 2-conv RPN head), not torchvision's defaults.
        kwargs.setdefault("heads", "vitdet")
    kwargs.setdefault("min_size", min(image_size))
    kwargs.setdefault("max_size", max(image_size))
    return _factory().create(arch, backbone, num_classes, engine=engine if rev else "autograd",
                           backbone_args=backbone_args, **kwargs)


def _check(name: str, batch_size: Any, engine: str) -> None:
    _, backbone = _factory().parse_name(name)
    _factory().check_backbone(backbone)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"expected a positive integer batch size, got {batch_size!r}")
    if engine not in DETECTOR_ENGINES:
        raise ValueError(f"expected a detector's engine among {', '.join(DETECTOR_ENGINES)}, "
                         f"got {engine!r}")


def plan_detector(
    name: str,
    batch_size: int,
    engine: str,
    amp: Any = None,
    optimizer: str = "adamw",
    device: str = "cuda",
    chunk_bytes: Any = None,
    grad_checkpointing: bool = False,
    img_size: Any = 1024,
    num_classes: int = 81,
    gt_per_image: int = DEFAULT_GT_PER_IMAGE,
    **detector_kwargs: Any,
) -> MemoryReport:
    """Predict a detector's training step (:func:`detector_memory_report`), allocating nothing.

    Args:
        name: ``ARCH:BACKBONE`` (``maskrcnn:detectron2:vitdet_b``).
        batch_size: images per step.
        engine: ``reversible``, ``pareprop``, ``plain`` or ``checkpointed`` (module docstring).
        amp, optimizer, device, chunk_bytes: as :func:`pareprop.plan_memory` takes them.
        grad_checkpointing: reversible engines: the backbone's blocks that are not reversible
            (MViT's stage transitions) under activation checkpointing
            (:func:`apply_detector_engine`; ``checkpointed`` always does).
        img_size: the images' size, ``1024``, ``"1024x1024"`` or ``(H, W)``; the detector's
            ``min_size``/``max_size`` default to it, so they enter its backbone unresized.
        num_classes: classes including background (81: COCO).
        gt_per_image: ground-truth instances per image (boxes and full-size masks).
        **detector_kwargs: :func:`pareprop.detection.create_detector`'s keywords
            (``heads``, ``backbone_args``, ``rpn_post_nms_top_n_train``...).

    Returns:
        A :class:`MemoryReport` (``method="tracked_fake"``) whose ``split`` gives the peak's
        parts (NOTE [ The peak split of a detector ]).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check(name, batch_size, engine)
    if chunk_bytes is not None and engine not in REVERSIBLE_ENGINES:
        raise ValueError(f"chunk_bytes chunks the branches of a reversible engine's backward; "
                         f"engine {engine!r} has none (use reversible or pareprop)")
    if isinstance(chunk_bytes, str) and chunk_bytes.strip().lower() == "auto":
        raise ValueError("chunk_bytes='auto' is not planned for detectors; give a size")
    if isinstance(chunk_bytes, Chunking):  # parsed where it entered (a plan sweep)
        if chunk_bytes.max_bytes is None:
            raise ValueError(f"expected a chunk size in bytes, got {chunk_bytes!r}")
        chunk_bytes = chunk_bytes.max_bytes
    size = None if chunk_bytes is None else parse_memory(chunk_bytes)
    image_size = _parse_image_size(img_size)
    dtype = amp_dtype(amp)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"), cpu_linspace():
        detector = build_detector(name, engine, num_classes, image_size, detector_kwargs)
    with fake_mode:
        detector.to_empty(device="cpu")
    if grad_checkpointing and engine not in REVERSIBLE_ENGINES:
        raise ValueError(f"grad_checkpointing is for the reversible engines (engine "
                         f"'checkpointed' checkpoints every block already), got {engine!r}")
    apply_detector_engine(detector, engine, grad_checkpointing)
    with fake_mode:
        detector.train()
        images = [torch.empty(3, *image_size) for _ in range(batch_size)]
        masks = getattr(detector.roi_heads, "mask_roi_pool", None) is not None
    targets = synthetic_targets(batch_size, image_size, num_classes, gt_per_image, False)
    with fake_mode:
        targets = [dict(t, boxes=t["boxes"].clone()) for t in targets]  # fake copies
        if masks:
            for t in targets:
                t["masks"] = torch.empty(gt_per_image, *image_size, dtype=torch.uint8)
        foreach = True if torch.device(device).type == "cuda" else None
        opt = make_optimizer(detector, optimizer, foreach=foreach)
        create_optimizer_state(detector, opt)
        set_chunking(detector, max_bytes=size)
        tracker = SplitTracker()
        with planning_values(), tracing_distinct_chunks(), worst_case_sampling(detector):
            counts = detector_step(detector, images, targets, opt, dtype, tracker)
    report = _report(counts, tracker, name, engine, batch_size, dtype, str(device),
                     "tracked_fake", size)
    report.grad_checkpointing = bool(grad_checkpointing)
    return report


def _report(counts: Dict[str, int], tracker: SplitTracker, name: str, engine: str,
            batch_size: int, dtype: Optional[torch.dtype], device: str, method: str,
            chunk_bytes: Optional[int]) -> MemoryReport:
    return MemoryReport(**counts, peak=int(tracker.peak), model=name, engine=engine,
                        batch_size=batch_size, amp=amp_label(dtype), device=device,
                        method=method, chunk_bytes=chunk_bytes,
                        split={k: int(v) for k, v in tracker.split.items()})


def detector_memory_report(
    detector: nn.Module,
    images: Sequence[torch.Tensor],
    targets: Sequence[dict],
    engine: Optional[str] = None,
    optimizer: str = "adamw",
    amp: Any = None,
    name: str = "",
    grad_checkpointing: bool = False,
) -> MemoryReport:
    """Measure one training step of a torchvision detector on real CPU tensors, with the peak
    split (NOTE [ The peak split of a detector ]); what :func:`plan_detector` predicts.

    ``engine`` is applied by :func:`apply_detector_engine` (``plain`` keeps the detector's
    engines: build it under ``autograd`` for the unconverted network).
    """
    images, targets = list(images), list(targets)
    if not images or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in images):
        raise ValueError("expected images as a list of (3, H, W) tensors")
    if len(targets) != len(images) or not all(isinstance(t, dict) for t in targets):
        raise ValueError("expected one target dict per image")
    if images[0].device.type != "cpu":
        raise ValueError("expected CPU tensors: the split is counted by a tracker of real CPU "
                         "storages (on CUDA use torch.cuda.max_memory_allocated)")
    dtype = amp_dtype(amp)
    apply_detector_engine(detector, engine, grad_checkpointing)
    detector.train()
    opt = make_optimizer(detector, optimizer)
    create_optimizer_state(detector, opt)
    tracker = SplitTracker()
    counts = detector_step(detector, images, targets, opt, dtype, tracker)
    return _report(counts, tracker, name or type(detector).__name__, engine or "",
                   len(images), dtype, "cpu", "tracked_real", None)
