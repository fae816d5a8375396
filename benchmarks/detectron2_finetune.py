"""The inputs of a short detectron2 fine-tune on the shapes (BENCHMARKS.md, "Detection
training"): a small ViTDet configuration's initial weights written in detectron2's model-zoo
layout (no real detectron2 file can be downloaded here), a small shapes set, and the detector's
options as a ``pareprop train --config`` file. Then:

    PYTHONPATH=src python benchmarks/detectron2_finetune.py runs/d2ft
    PYTHONPATH=src python -m pareprop train --task detection \\
        --model maskrcnn:detectron2:vitdet_b --config runs/d2ft/small.json \\
        --pretrained-file runs/d2ft/vitdet_small.pkl --dataset runs/d2ft/shapes \\
        --epochs 4 --coupling-steps 40 --out runs/d2ft/run --no-progress
"""

from __future__ import annotations

import argparse
import json
import os
import pickle

import torch

from pareprop.data.shapes import write_shapes
from pareprop.detection.detectron2 import build_detectron2_backbone

# ViTDet-B's architecture at a shapes scale: 4 blocks of width 64 over 128x128 images (8x8
# patches of 16), two of them windowed, a 64-channel simple feature pyramid.
BACKBONE = dict(embed_dim=64, depth=4, num_heads=4, window_size=4, window_block_indexes=[0, 2],
                img_size=128, pretrain_img_size=128)
FPN_CHANNELS = 64
# The default shapes detector's heads and samples (pareprop.trainer.PRESETS).
DETECTOR = dict(
    backbone_args=BACKBONE, fpn_channels=FPN_CHANNELS, heads="small", min_size=128,
    max_size=128, rpn_batch_size_per_image=64, box_batch_size_per_image=64,
    rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=100, rpn_pre_nms_top_n_test=300,
    rpn_post_nms_top_n_test=100, box_detections_per_img=20,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for shapes/, vitdet_small.pkl and small.json")
    parser.add_argument("--num-train", type=int, default=160)
    parser.add_argument("--num-val", type=int, default=40)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_shapes(os.path.join(args.out, "shapes"), num_train=args.num_train,
                 num_val=args.num_val, image_size=128)
    torch.manual_seed(0)
    state = build_detectron2_backbone("vitdet_b", out_channels=FPN_CHANNELS,
                                      **BACKBONE).state_dict()
    # The model zoo's layout: a pickle of {"model": {"backbone.NAME": numpy array}}.
    with open(os.path.join(args.out, "vitdet_small.pkl"), "wb") as f:
        pickle.dump({"model": {f"backbone.{k}": v.numpy() for k, v in state.items()}}, f)
    with open(os.path.join(args.out, "small.json"), "w") as f:
        json.dump({"model_kwargs": DETECTOR}, f, indent=1)


if __name__ == "__main__":
    main()
