"""The data-dependent parts of a torchvision detector's training step, at their worst case.

NOTE [ Planning a detector's worst case ]
    Proposal selection (score threshold, small-box removal, NMS), the matching of anchors and
    proposals to the ground truth and the random sampling of anchors and RoIs all choose how
    many rows the heads see from the data, and a fake tensor has none: ``nonzero`` and
    ``torch.where(cond)`` have no size on it. The memory of the step, though, depends only on
    those counts, and the configuration caps each one. So while a detector is planned, its
    data-dependent methods are replaced by versions that make the largest choice the
    configuration allows, with index tensors of that fixed size:

    * ``transform.torch_choice`` (a random training size): the largest;
    * ``rpn.filter_proposals``: ``post_nms_top_n`` proposals per image (NMS removes none), the
      best-scored ones, clipped to the image;
    * ``rpn.assign_targets_to_anchors``: the IoU matrix of every anchor with every box, as
      the matcher computes it, and every anchor matched; ``rpn.compute_loss``: the sampler's
      full ``batch_size_per_image`` anchors per image, its positive fraction of them positive;
    * ``roi_heads.select_training_samples``: the ground truth appended to the proposals, then
      ``batch_size_per_image`` RoIs per image, ``positive_fraction`` of them positive (as many
      positives as the sampler takes), and ``fastrcnn_loss`` on those positives;
    * in ``roi_heads.forward``, the mask branch's positives (``torch.where(labels > 0)``) are
      those same positives, and ``MultiScaleRoIAlign`` puts every RoI on one level (the
      largest transient: all RoIs pooled by one ``roi_align`` before they are scattered).

    Everything else (the transform, backbone, pyramid, RPN head, anchors, box coding, RoI
    pooling, the heads and every loss's arithmetic) is torchvision's own code. A real step
    reaches this worst case when the image holds enough boxes and NMS removes nothing
    (``tests/test_plan_detection.py`` builds one, and the plan matches it within 5%).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

import torch
import torch.nn.functional as F
import torchvision.models.detection.roi_heads as tv_roi_heads
from torch.overrides import TorchFunctionMode
from torchvision.ops import box_iou
from torchvision.ops import boxes as box_ops

__all__ = ["worst_case_sampling"]


def _fake(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__name__ == "FakeTensor"


class _WorstCaseWhere(TorchFunctionMode):
    """Answers ``torch.where(cond)`` (one argument) on fake tensors inside the RoI heads: in
    RoI pooling every RoI on the first level asked, elsewhere the planned positives."""

    def __init__(self, positives: int):
        super().__init__()
        self.positives = positives
        self.pooling = False
        self.level_given = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.where and len(args) == 1 and not kwargs and _fake(args[0]):
            cond = args[0]
            if self.pooling:
                n = 0 if self.level_given else cond.shape[0]
                self.level_given = True
            else:
                n = min(self.positives, cond.shape[0])
            return (torch.arange(n, device=cond.device),)
        return func(*args, **kwargs)


def _filter_proposals(rpn: Any):
    def filter_proposals(proposals, objectness, image_shapes, num_anchors_per_level):
        objectness = objectness.detach().reshape(proposals.shape[0], -1)
        k = min(rpn.post_nms_top_n(), objectness.shape[1])
        boxes, scores = [], []
        for props, obj, shape in zip(proposals, objectness, image_shapes):
            top, idx = obj.topk(k)
            boxes.append(box_ops.clip_boxes_to_image(props[idx], shape))
            scores.append(torch.sigmoid(top))
        return boxes, scores
    return filter_proposals


def _assign_anchors(rpn: Any):
    def assign_targets_to_anchors(anchors, targets):
        labels, matched = [], []
        for anchors_per_image, target in zip(anchors, targets):
            gt = target["boxes"]
            quality = box_iou(gt, anchors_per_image)  # what the matcher holds
            vals, _ = quality.max(dim=0)
            del quality, vals
            idx = torch.arange(anchors_per_image.shape[0], device=gt.device) % max(gt.shape[0], 1)
            matched.append(gt[idx] if gt.shape[0] else torch.zeros_like(anchors_per_image))
            labels.append(torch.ones(anchors_per_image.shape[0], dtype=torch.float32,
                                     device=gt.device))
        return labels, matched
    return assign_targets_to_anchors


def _rpn_loss(rpn: Any):
    def compute_loss(objectness, pred_bbox_deltas, labels, regression_targets):
        per_image = labels[0].shape[0]
        num = min(rpn.fg_bg_sampler.batch_size_per_image, per_image)
        pos = int(num * rpn.fg_bg_sampler.positive_fraction)
        base = torch.arange(len(labels), device=objectness.device)[:, None] * per_image
        pos_inds = (base + torch.arange(pos, device=base.device)).flatten()
        neg_inds = (base + torch.arange(pos, num, device=base.device)).flatten()
        inds = torch.cat([pos_inds, neg_inds])
        objectness = objectness.flatten()
        labels = torch.cat(labels, dim=0)
        regression_targets = torch.cat(regression_targets, dim=0)
        box_loss = F.smooth_l1_loss(pred_bbox_deltas[pos_inds], regression_targets[pos_inds],
                                    beta=1 / 9, reduction="sum") / inds.numel()
        loss = F.binary_cross_entropy_with_logits(objectness[inds], labels[inds])
        return loss, box_loss
    return compute_loss


def _select_samples(heads: Any, state: dict):
    def select_training_samples(proposals, targets):
        heads.check_targets(targets)
        dtype = proposals[0].dtype
        gt_boxes = [t["boxes"].to(dtype) for t in targets]
        gt_labels = [t["labels"] for t in targets]
        proposals = heads.add_gt_proposals(proposals, gt_boxes)
        sampler = heads.fg_bg_sampler
        num = min(sampler.batch_size_per_image, min(p.shape[0] for p in proposals))
        pos = int(sampler.batch_size_per_image * sampler.positive_fraction)
        pos = min(pos, num)
        state.update(per_image=num, positives=pos)
        out_props, matched_idxs, labels, matched_boxes = [], [], [], []
        for props, gt, gt_lab in zip(proposals, gt_boxes, gt_labels):
            iou = box_iou(gt, props)  # what the matcher holds
            del iou
            g = max(gt.shape[0], 1)
            idx = torch.arange(num, device=props.device) % g
            lab = gt_lab[idx] if gt.shape[0] else torch.zeros(num, dtype=torch.int64)
            lab = torch.cat([lab[:pos], torch.zeros_like(lab[pos:])])
            out_props.append(props[torch.arange(num, device=props.device)])
            matched_idxs.append(idx)
            labels.append(lab)
            matched_boxes.append(gt[idx] if gt.shape[0] else torch.zeros_like(out_props[-1]))
        regression_targets = heads.box_coder.encode(matched_boxes, out_props)
        return out_props, matched_idxs, labels, regression_targets
    return select_training_samples


def _fastrcnn_loss(state: dict):
    def fastrcnn_loss(class_logits, box_regression, labels, regression_targets):
        num_images = len(labels)
        labels = torch.cat(labels, dim=0)
        regression_targets = torch.cat(regression_targets, dim=0)
        classification_loss = F.cross_entropy(class_logits, labels)
        base = torch.arange(num_images, device=labels.device)[:, None] * state["per_image"]
        pos = (base + torch.arange(state["positives"], device=base.device)).flatten()
        n = class_logits.shape[0]
        box_regression = box_regression.reshape(n, box_regression.size(-1) // 4, 4)
        box_loss = F.smooth_l1_loss(box_regression[pos, labels[pos]], regression_targets[pos],
                                    beta=1 / 9, reduction="sum") / labels.numel()
        return classification_loss, box_loss
    return fastrcnn_loss


def _pooling_hooks(pool: Optional[torch.nn.Module], where: _WorstCaseWhere) -> List[Any]:
    if pool is None:
        return []

    def enter(module, args):
        where.pooling, where.level_given = True, False

    def leave(module, args, out):
        where.pooling = False

    return [pool.register_forward_pre_hook(enter), pool.register_forward_hook(leave)]


@contextlib.contextmanager
def worst_case_sampling(detector: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``detector``'s data-dependent steps take their worst case with fixed
    index tensors (NOTE [ Planning a detector's worst case ]), so its training step runs on
    fake tensors; the detector is as it was afterwards."""
    rpn = getattr(detector, "rpn", None)
    heads = getattr(detector, "roi_heads", None)
    if rpn is None or heads is None:
        raise ValueError(f"expected a torchvision R-CNN detector (rpn and roi_heads), got "
                         f"{type(detector).__name__}")
    state: dict = {"per_image": 0, "positives": 0}
    patched = {
        (rpn, "filter_proposals"): _filter_proposals(rpn),
        (rpn, "assign_targets_to_anchors"): _assign_anchors(rpn),
        (rpn, "compute_loss"): _rpn_loss(rpn),
        (heads, "select_training_samples"): _select_samples(heads, state),
    }
    transform = getattr(detector, "transform", None)
    if transform is not None:  # a random training size: the largest
        patched[(transform, "torch_choice")] = lambda sizes: max(sizes)
    where = _PositivesWhere(state)
    hooks = _pooling_hooks(heads.box_roi_pool, where) + _pooling_hooks(
        getattr(heads, "mask_roi_pool", None), where)
    for (obj, name), fn in patched.items():
        setattr(obj, name, fn)
    original_loss = tv_roi_heads.fastrcnn_loss
    tv_roi_heads.fastrcnn_loss = _fastrcnn_loss(state)
    try:
        with where:
            yield
    finally:
        tv_roi_heads.fastrcnn_loss = original_loss
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute hid the class's method
        for hook in hooks:
            hook.remove()


class _PositivesWhere(_WorstCaseWhere):
    """:class:`_WorstCaseWhere` whose positives are read when asked (the sampler sets them)."""

    def __init__(self, state: dict):
        super().__init__(0)
        self._state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.positives = self._state["positives"]
        return super().__torch_function__(func, types, args, kwargs)
