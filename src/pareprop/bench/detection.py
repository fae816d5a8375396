"""A detector's training step in ``pareprop bench``: a tiny Mask R-CNN on a reversible
Rev-MViTv2 backbone, on small images, per engine: its step time, its peak (a real step
counted by the CPU tracker) split into backbone, pyramid and heads, and the plan of the same
step (:func:`pareprop.memory.detection.plan_detector`), so the default bench shows that a
detector trains under every engine and that its plan matches it.

The detector is sized so that the whole measurement takes a few seconds on a CPU.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import torch
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

from pareprop.memory.detection import (
    SPLIT_PARTS,
    build_detector,
    detector_memory_report,
    detector_step,
    plan_detector,
    synthetic_targets,
)
from pareprop.memory.step import create_optimizer_state, make_optimizer

__all__ = ["DETECTOR_BENCH", "bench_detector", "format_detector_table"]

# The detector of the default bench, and its step: 2 images of 64x64 with 8 boxes each.
DETECTOR_BENCH: Dict[str, Any] = dict(
    name="maskrcnn:rev_mvitv2_tiny", img_size=64, batch_size=2, num_classes=4, gt_per_image=8,
    width=32,
    kwargs=dict(
        rpn_post_nms_top_n_train=64, rpn_batch_size_per_image=64,
        box_batch_size_per_image=32, rpn_nms_thresh=1.0,
        backbone_args=dict(depth=4, embed_dim=32, last_block_indexes=(0, 1, 2, 3), img_size=64),
    ),
)


def _kwargs() -> Dict[str, Any]:
    """The detector's keywords, with heads as narrow as the pyramid: torchvision's default
    mask head (four 256-channel convs on every positive RoI) would be most of the step."""
    cfg = DETECTOR_BENCH
    c, k = cfg["width"], cfg["num_classes"]
    return dict(cfg["kwargs"], fpn_channels=c,
                box_head=TwoMLPHead(c * 7 * 7, 2 * c), box_predictor=FastRCNNPredictor(2 * c, k),
                mask_head=MaskRCNNHeads(c, (c, c), 1), mask_predictor=MaskRCNNPredictor(c, c, k))


def bench_detector(engines: Sequence[str] = ("reversible",), plan: bool = True,
                   seed: int = 0) -> List[Dict[str, Any]]:
    """One record per engine: ``model``, ``engine``, ``batch_size``, ``img_size``,
    ``step_s`` (one untracked step after a warm-up), ``peak_bytes`` (a real step counted on
    the CPU), ``planned_peak_bytes`` (None without ``plan``), ``split`` (of the real peak)."""
    cfg = DETECTOR_BENCH
    size = (cfg["img_size"], cfg["img_size"])
    records = []
    for engine in engines:
        torch.manual_seed(seed)
        det = build_detector(cfg["name"], engine, cfg["num_classes"], size, _kwargs())
        images = [torch.rand(3, *size) for _ in range(cfg["batch_size"])]
        targets = synthetic_targets(cfg["batch_size"], size, cfg["num_classes"],
                                    cfg["gt_per_image"], masks=True)
        report = detector_memory_report(det, images, targets, engine=engine,
                                        name=cfg["name"])  # also the warm-up
        opt = make_optimizer(det, "adamw")
        create_optimizer_state(det, opt)
        start = time.perf_counter()
        detector_step(det, images, targets, opt, None)
        step_s = time.perf_counter() - start
        planned = None
        if plan:
            planned = plan_detector(cfg["name"], cfg["batch_size"], engine, device="cpu",
                                    img_size=size, num_classes=cfg["num_classes"],
                                    gt_per_image=cfg["gt_per_image"], **_kwargs()).peak
        records.append({"model": cfg["name"], "engine": engine, "batch_size": cfg["batch_size"],
                        "img_size": cfg["img_size"], "step_s": step_s,
                        "peak_bytes": report.peak, "planned_peak_bytes": planned,
                        "split": report.split})
    return records


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_detector_table(records: Sequence[Dict[str, Any]]) -> str:
    """Step time, real and planned peak (MiB) and the real peak's split, per engine."""
    head = ("model", "engine", "bs", "px", "step s", "peak MiB", "planned MiB",
            *(f"{p} MiB" for p in SPLIT_PARTS))
    rows = [head] + [
        (r["model"], r["engine"], str(r["batch_size"]), str(r["img_size"]),
         f"{r['step_s']:.3f}", _mib(r["peak_bytes"]), _mib(r["planned_peak_bytes"]),
         *(_mib(r["split"].get(p)) for p in SPLIT_PARTS))
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
