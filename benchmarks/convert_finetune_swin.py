"""Fine-tuning a converted Swin through the coupling schedule, on a data set the machine makes
(sklearn's 8x8 digits), as ``convert_finetune.py``'s ``finetune`` part does for ViT.

Pretrain a tiny source on digits 0-4 (plain, autograd), then fine-tune it with a fresh head on
digits 5-9: converted, the cosine schedule (1, 0) -> (0, 1) over ``--schedule-steps`` steps,
reversible engine, precision guard on (tolerance 1e-3). Prints the loss of every epoch, the
validation accuracy, and after every epoch the guard's report of every stack (which blocks it
stores, and why): nothing is stored without a reason.

``--source swin``: timm's ``SwinTransformer`` on the images. ``--source swin3d``: torchvision's
``SwinTransformer3d`` (swin3d_t's patch and window shapes) on 8-frame clips of a digit drifting
4 pixels a frame in a random direction, scaled to 32x32 (a video the machine makes).

    PYTHONPATH=src python benchmarks/convert_finetune_swin.py --source swin
    PYTHONPATH=src python benchmarks/convert_finetune_swin.py --source swin3d
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from convert_finetune import _digits
from timm.models.swin_transformer import SwinTransformer

import pareprop
from pareprop.convert.swin3d import build_swin3d

TINY = dict(img_size=8, patch_size=1, in_chans=1, embed_dim=32, depths=(2, 2),
            num_heads=(2, 4), window_size=4, drop_path_rate=0.1)


FRAMES = 8


def _clips(split, seed):
    """Each digit, scaled to 32x32, as an 8-frame clip ``(C, T, H, W)`` drifting 4 pixels a
    frame (with wrap-around) in one of four directions, drawn per clip."""
    (x, y) = split
    x = F.interpolate(x, scale_factor=4, mode="nearest")  # (N, 1, 32, 32)
    g = torch.Generator().manual_seed(seed)
    steps = 4 * torch.tensor([(0, 1), (0, -1), (1, 0), (-1, 0)])[
        torch.randint(0, 4, (len(y),), generator=g)]
    clips = torch.stack([torch.stack([torch.roll(img, (int(t * dy), int(t * dx)), (-2, -1))
                                      for t in range(FRAMES)], dim=1)
                         for img, (dy, dx) in zip(x, steps)])  # (N, 1, T, 32, 32)
    return clips, y


def _epoch(model, opt, train, batch, g, on_step=None):
    model.train()
    order = torch.randperm(len(train[1]), generator=g)
    losses = []
    for i in range(0, len(order), batch):
        idx = order[i:i + batch]
        loss = F.cross_entropy(model(train[0][idx]), train[1][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step()
    return sum(losses) / len(losses)


def _accuracy(model, val):
    model.eval()
    with torch.no_grad():
        return (model(val[0]).argmax(-1) == val[1]).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("swin", "swin3d"), default="swin")
    p.add_argument("--pre-epochs", type=int, default=20)
    p.add_argument("--ft-epochs", type=int, default=8)
    p.add_argument("--schedule-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    (pre_train, pre_val), (ft_train, ft_val) = _digits(args.seed)
    if args.source == "swin3d":
        pre_train, pre_val, ft_train, ft_val = (_clips(split, args.seed + i) for i, split in
                                                enumerate((pre_train, pre_val, ft_train, ft_val)))
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    if args.source == "swin":
        source = SwinTransformer(num_classes=5, **TINY)
    else:  # swin3d_t's 2x4x4 patches, 8x7x7 windows: a (4, 8, 8) grid, shifted (padded) windows
        source = build_swin3d("swin3d_t", embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                              num_classes=5, stochastic_depth_prob=0.1)
        source.patch_embed.proj = torch.nn.Conv3d(1, 32, (2, 4, 4), (2, 4, 4))
    opt = torch.optim.AdamW(source.parameters(), lr=2e-3, weight_decay=0.05)
    for _ in range(args.pre_epochs):
        _epoch(source, opt, pre_train, 64, g)
    print(json.dumps({"pretrain_val_acc_digits_0_4": _accuracy(source, pre_val)}), flush=True)

    model = pareprop.convert(copy.deepcopy(source))
    torch.manual_seed(args.seed + 1)
    model.reset_classifier(5)  # digits 5-9: a fresh head
    schedule = pareprop.CouplingSchedule(model, "cosine", args.schedule_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    print(json.dumps({"before_val_acc_digits_5_9": _accuracy(model, ft_val)}), flush=True)
    for epoch in range(args.ft_epochs):
        loss = _epoch(model, opt, ft_train, 64, g, on_step=schedule.step)
        reports = model.precision_guard.reports
        print(json.dumps({
            "epoch": epoch + 1, "train_loss": round(loss, 4),
            "val_acc": round(_accuracy(model, ft_val), 4),
            "coupling": [round(c, 4) for c in pareprop.coupling_of(model)],
            "stored": [list(stack.stored_blocks) for stack in model.precision_guard.stacks],
        }), flush=True)
        for i, report in enumerate(reports):
            print(f"  stage {i}: {report}", flush=True)


if __name__ == "__main__":
    main()
