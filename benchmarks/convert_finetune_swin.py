"""Fine-tuning a converted timm Swin through the coupling schedule, on a data set the machine
makes (sklearn's 8x8 digits), as ``convert_finetune.py``'s ``finetune`` part does for ViT.

Pretrain a tiny timm ``SwinTransformer`` on digits 0-4 (plain timm, autograd), then fine-tune
it with a fresh head on digits 5-9: converted, the cosine schedule (1, 0) -> (0, 1) over
``--schedule-steps`` steps, reversible engine, precision guard on (tolerance 1e-3). Prints the
loss of every epoch, the validation accuracy, and after every epoch the guard's report of
every stack (which blocks it stores, and why): nothing is stored without a reason.

    PYTHONPATH=src python benchmarks/convert_finetune_swin.py
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

TINY = dict(img_size=8, patch_size=1, in_chans=1, embed_dim=32, depths=(2, 2),
            num_heads=(2, 4), window_size=4, drop_path_rate=0.1)


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
    p.add_argument("--pre-epochs", type=int, default=20)
    p.add_argument("--ft-epochs", type=int, default=8)
    p.add_argument("--schedule-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    (pre_train, pre_val), (ft_train, ft_val) = _digits(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    source = SwinTransformer(num_classes=5, **TINY)
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
            "stored": [list(stage.stack.stored_blocks) for stage in model.layers],
        }), flush=True)
        for i, report in enumerate(reports):
            print(f"  stage {i}: {report}", flush=True)


if __name__ == "__main__":
    main()
