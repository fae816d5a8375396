"""Planning a detector's training step: the plan (fake tensors, worst-case sampling) against a
real CPU step made to reach that worst case, the peak split, and refusals of bad names."""

import pytest
import torch

import pareprop
from pareprop.memory.detection import (
    SPLIT_PARTS,
    build_detector,
    detector_memory_report,
    plan_detector,
    synthetic_targets,
)

NAME = "maskrcnn:rev_mvitv2_tiny"
SIZE = 64
GT = 10
# A tiny detector whose every proposal and RoI slot the real step fills: NMS at IoU 1.0 removes
# nothing, 10 boxes an image give the 8 positives of 32 RoIs (the boxes themselves are
# appended to the proposals), and boxes under 112 px put every RoI on p2.
KW = dict(
    rpn_post_nms_top_n_train=50, rpn_batch_size_per_image=32, box_batch_size_per_image=32,
    rpn_nms_thresh=1.0,
    backbone_args=dict(depth=4, embed_dim=32, last_block_indexes=(0, 1, 2, 3), img_size=SIZE),
)


def _real(engine, amp, counts, gc=False):
    torch.manual_seed(0)
    det = build_detector(NAME, engine, 4, (SIZE, SIZE), KW)
    rpn_filter, select = det.rpn.filter_proposals, det.roi_heads.select_training_samples

    def filter_proposals(*args):
        boxes, scores = rpn_filter(*args)
        counts["proposals"] = [len(b) for b in boxes]
        return boxes, scores

    def select_training_samples(*args):
        out = select(*args)
        counts["rois"] = [len(p) for p in out[0]]
        counts["positives"] = [int((lab > 0).sum()) for lab in out[2]]
        return out

    det.rpn.filter_proposals = filter_proposals
    det.roi_heads.select_training_samples = select_training_samples
    images = [torch.rand(3, SIZE, SIZE) for _ in range(2)]
    targets = synthetic_targets(2, (SIZE, SIZE), 4, GT, masks=True)
    return detector_memory_report(det, images, targets, engine=engine, amp=amp, optimizer="none",
                                  grad_checkpointing=gc)


@pytest.mark.parametrize("engine,amp,gc", [
    pytest.param("reversible", None, False, marks=pytest.mark.slow),
    pytest.param("checkpointed", "bf16", False, marks=pytest.mark.slow),
    ("reversible", "bf16", True)])
def test_plan_matches_a_real_step_at_the_worst_case(engine, amp, gc):
    counts = {}
    real = _real(engine, amp, counts, gc)
    # The real step reached the worst case the configuration allows.
    assert counts["proposals"] == [50, 50]
    assert counts["rois"] == [32, 32] and counts["positives"] == [8, 8]
    plan = plan_detector(NAME, 2, engine, amp=amp, optimizer="none", device="cpu",
                         img_size=SIZE, num_classes=4, gt_per_image=GT, grad_checkpointing=gc,
                         **KW)
    assert plan.grad_checkpointing == gc
    assert plan.method == "tracked_fake" and real.method == "tracked_real"
    assert abs(plan.peak - real.peak) <= 0.05 * real.peak
    assert abs(plan.activations - real.activations) <= 0.05 * real.activations
    for part in ("backbone", "pyramid", "heads"):
        assert abs(plan.split[part] - real.split[part]) <= 0.05 * real.peak, part


def test_split_sums_to_the_peak_and_the_engines_differ_in_the_backbone():
    plans = {e: pareprop.plan_memory(NAME, 2, e, amp=None, optimizer="adamw", device="cpu",
                                     img_size=SIZE, num_classes=4, gt_per_image=GT, **KW)
             for e in ("plain", "reversible")}
    for plan in plans.values():
        assert set(plan.split) == set(SPLIT_PARTS)
        assert sum(plan.split.values()) == plan.peak
        assert plan.to_dict()["split"] == plan.split
        assert "at the peak: backbone" in plan.table()
    assert plans["reversible"].floor > 0 and plans["plain"].floor == 0
    # The transitions checkpointed keep less than the same reversible step without.
    gc = pareprop.plan_memory(NAME, 2, "reversible", device="cpu", img_size=SIZE, num_classes=4,
                              gt_per_image=GT, grad_checkpointing=True, **KW)
    assert gc.activations < plans["reversible"].activations


@pytest.mark.parametrize("name,engine,match", [
    ("maskrcnn:detectron2:nope", "reversible", "unknown detectron2 backbone"),
    ("maskrcnn:not_a_backbone", "reversible", "unknown detection backbone"),
    ("yolo:rev_mvitv2_tiny", "reversible", "yolo"),
    ("maskrcnn:rev_mvitv2_tiny", "autograd", "detector's engine"),
])
def test_bad_names_and_engines_are_refused_in_one_line(name, engine, match):
    with pytest.raises(ValueError, match=match) as err:
        pareprop.plan_memory(name, 1, engine, img_size=SIZE)
    assert "\n" not in str(err.value)


def test_bad_options_are_refused_in_one_line():
    for kwargs, match in ((dict(img_size="64y64"), "image size"),
                          (dict(chunk_bytes="1MiB", engine="plain"), "chunk_bytes"),
                          (dict(memory_budget=0.5), "memory_budget")):
        kwargs = dict(kwargs)
        engine = kwargs.pop("engine", "reversible")
        with pytest.raises(ValueError, match=match) as err:
            pareprop.plan_memory(NAME, 1, engine, **kwargs)
        assert "\n" not in str(err.value)
