"""What converting a pretrained timm ViT (pareprop.convert) is worth, in three measurements.

* ``errors``: rebuilt-input and gradient error of one training step of a converted ViT
  against a float64 autograd reference, for skip scales beta (alpha = 1 - beta, the schedule's
  path) and depths, in float32 and under bf16 autocast; and how many blocks the precision guard
  stores there (tolerance 1e-3). A table and a plot.
* ``memory``: the planned largest fine-tuning batch (AdamW, bf16 autocast, CUDA) of a converted
  vit_large_patch16_224 in 80 GiB, at (1, 0) (every block stored) and at (0, 1) (every block
  rebuilt), against timm's ViT-L with and without its gradient checkpointing
  (pareprop.largest_batch; planned, not run).
* ``finetune``: a CPU experiment: pretrain a tiny timm ViT on digits 0-4 (sklearn's 8x8
  digits), then fine-tune it four ways on digits 5-9 with a fresh head: plain (timm, autograd),
  the cosine schedule (1, 0) -> (0, 1), (0, 1) at once (Re2TAL), and the same reversible
  network from scratch (no pretraining). Validation accuracy, activation bytes of a step and
  median step time.

    PYTHONPATH=src python benchmarks/convert_finetune.py --part all --out runs/convert_finetune
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import pareprop
from pareprop.convert.precision_guard import measure_rebuild_errors

GIB = 2**30


# -- errors ----------------------------------------------------------------------------------

def errors(depths=(4, 8, 12), betas=(0.1, 0.25, 0.5, 0.75, 1.0), width=96, heads=2,
           batch=4, seed=0) -> List[Dict[str, Any]]:
    rows = []
    for amp in ("float32", "bfloat16"):
        for depth in depths:
            for beta in betas:
                torch.manual_seed(seed)
                source = VisionTransformer(img_size=32, patch_size=4, embed_dim=width,
                                           depth=depth, num_heads=heads, num_classes=10)
                model = pareprop.convert(source, tolerance=None)
                pareprop.set_coupling(model, 1.0 - beta, beta)
                x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
                amp_dtype = torch.bfloat16 if amp == "bfloat16" else None
                report = pareprop.drift_report(model, x, amp_dtype=amp_dtype,
                                               reference_dtype=torch.float64,
                                               engines=("autograd", "reversible"))
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                                     enabled=amp_dtype is not None):
                    tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
                    _, stored = measure_rebuild_errors(model.stack, tokens, tokens, 1e-3)
                rebuilt = [e for e in report.reconstruction["reversible"] if e == e]
                guarded = float("nan")
                if stored:  # the same step with the blocks the guard stores
                    model.stack.store_blocks(stored)
                    guarded = pareprop.drift_report(
                        model, x, amp_dtype=amp_dtype, reference_dtype=torch.float64,
                        engines=("reversible",)).grad_error["reversible"]
                    model.stack.store_blocks([])
                rows.append(dict(
                    amp=amp, depth=depth, beta=beta,
                    rebuilt_worst=max(rebuilt) if rebuilt else float("nan"),
                    grad_autograd=report.grad_error["autograd"],
                    grad_reversible=report.grad_error["reversible"],
                    guard_stored=len(stored),
                    grad_reversible_guarded=guarded if stored else report.grad_error["reversible"],
                ))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def errors_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| autocast | depth | beta | worst rebuilt input | grad error autograd | "
             "grad error reversible, unguarded | blocks the guard stores | "
             "grad error reversible, guarded |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['amp']} | {r['depth']} | {r['beta']:g} | {r['rebuilt_worst']:.1e} | "
                     f"{r['grad_autograd']:.1e} | {r['grad_reversible']:.1e} | "
                     f"{r['guard_stored']} of {r['depth']} | "
                     f"{r['grad_reversible_guarded']:.1e} |")
    return "\n".join(lines)


def errors_plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True, sharey=True)
    for ax, amp in zip(axes, ("float32", "bfloat16")):
        sub = [r for r in rows if r["amp"] == amp]
        for depth in sorted({r["depth"] for r in sub}):
            line = [r for r in sub if r["depth"] == depth]
            p = ax.plot([r["beta"] for r in line], [r["grad_reversible"] for r in line],
                        marker="o", label=f"reversible, unguarded, depth {depth}")
            ax.plot([r["beta"] for r in line], [r["grad_reversible_guarded"] for r in line],
                    marker="x", ls=":", color=p[0].get_color(),
                    label=f"reversible, guarded, depth {depth}")
            ax.plot([r["beta"] for r in line], [r["grad_autograd"] for r in line], ls="--",
                    color=p[0].get_color(), alpha=0.6, label=f"autograd, depth {depth}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("skip scale beta (alpha = 1 - beta)")
        ax.set_title(f"{amp}: gradient error vs float64 autograd")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative error of all parameter gradients")
    axes[1].legend(fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- memory ----------------------------------------------------------------------------------

def memory(budget="80GiB") -> List[Dict[str, Any]]:
    from pareprop.memory.plan import parse_memory

    limit = parse_memory(budget)
    common = dict(amp="bf16", device="cuda")
    converted = dict(source="vit_large_patch16_224", tolerance=None)
    cases = [
        ("timm vit_large_patch16_224", "vit_large_patch16_224", "plain", {}),
        ("timm vit_large_patch16_224, grad checkpointing", "vit_large_patch16_224",
         "checkpointed", {}),
        ("converted, (1, 0): every block stored", "converted_vit", "reversible",
         dict(converted, coupling=(1.0, 0.0))),
        ("converted, (0, 1): every block rebuilt", "converted_vit", "reversible",
         dict(converted, coupling=(0.0, 1.0))),
    ]
    rows = []
    for label, name, engine, extra in cases:
        t0 = time.perf_counter()
        batch, reports = pareprop.largest_batch(name, engine, limit, start=64, **common, **extra)
        best = next(r for r in reports if r.batch_size == batch) if batch else None
        rows.append(dict(model=label, engine=engine, largest_batch=batch,
                         peak_gib=best.peak / GIB if best else float("nan"),
                         plan_s=time.perf_counter() - t0))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| model | engine | largest batch in 80 GiB | planned peak at it (GiB) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['engine']} | {r['largest_batch']} | "
                     f"{r['peak_gib']:.1f} |")
    return "\n".join(lines)


# -- finetune --------------------------------------------------------------------------------

TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=6, num_heads=4)


def _digits(seed=0):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(data.target)
    g = torch.Generator().manual_seed(seed)

    def split(classes):
        idx = torch.nonzero(torch.isin(y, torch.tensor(classes))).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        cut = int(0.7 * len(idx))
        labels = y - classes[0]
        return (x[idx[:cut]], labels[idx[:cut]]), (x[idx[cut:]], labels[idx[cut:]])

    return split([0, 1, 2, 3, 4]), split([5, 6, 7, 8, 9])


def _fit(model, train, val, epochs, lr, batch=64, on_step=None, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(train[1]), generator=g)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(train[0][idx]), train[1][idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step()
    model.eval()
    with torch.no_grad():
        acc = (model(val[0]).argmax(-1) == val[1]).float().mean().item()
    return acc, statistics.median(times)


def finetune(pre_epochs=30, ft_epochs=12, schedule_steps=40, seed=0) -> Dict[str, Any]:
    torch.set_num_threads(1)
    (pre_train, pre_val), (ft_train, ft_val) = _digits(seed)
    torch.manual_seed(seed)
    pretrained = VisionTransformer(num_classes=5, **TINY)
    pre_acc, _ = _fit(pretrained, pre_train, pre_val, pre_epochs, 2e-3, seed=seed)
    print(json.dumps({"pretrain_val_acc_digits_0_4": pre_acc}), flush=True)

    def fresh_head(m):
        torch.manual_seed(seed + 1)
        m.reset_classifier(5)
        return m

    x = ft_train[0][:64]
    rows = []

    def run(label, model, on_step=None, activation_of=None):
        acc, step_s = _fit(model, ft_train, ft_val, ft_epochs, 1e-3, on_step=on_step, seed=seed)
        model.train()
        kept = pareprop.activation_bytes(activation_of or model, x)
        rows.append(dict(way=label, val_acc=acc, step_ms=1e3 * step_s,
                         activation_kib=kept / 2**10))
        print(json.dumps(rows[-1]), flush=True)

    run("plain fine-tuning (timm, autograd)", fresh_head(copy.deepcopy(pretrained)))
    model = pareprop.convert(fresh_head(copy.deepcopy(pretrained)))
    schedule = pareprop.CouplingSchedule(model, "cosine", schedule_steps)
    run(f"cosine schedule (1, 0) -> (0, 1) over {schedule_steps} steps, reversible",
        model, on_step=schedule.step)
    model = pareprop.convert(fresh_head(copy.deepcopy(pretrained)))
    pareprop.CouplingSchedule(model, "reversible")
    run("(0, 1) from the first step (Re2TAL), reversible", model)
    torch.manual_seed(seed + 2)
    scratch = pareprop.convert(VisionTransformer(num_classes=5, **TINY))
    pareprop.set_coupling(scratch, 0.0, 1.0)
    run("reversible (0, 1) from scratch, no pretraining", scratch)
    return dict(pretrain_val_acc=pre_acc, rows=rows, config=dict(
        TINY, pre_epochs=pre_epochs, ft_epochs=ft_epochs, schedule_steps=schedule_steps,
        train=len(ft_train[1]), val=len(ft_val[1])))


def finetune_table(result: Dict[str, Any]) -> str:
    lines = ["| fine-tuning | val accuracy (digits 5-9) | activation KiB (batch 64) | "
             "median step (ms) |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['way']} | {100 * r['val_acc']:.1f}% | {r['activation_kib']:.0f} | "
                     f"{r['step_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("errors", "memory", "finetune", "all"), default="all")
    parser.add_argument("--out", default="runs/convert_finetune")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = ("errors", "memory", "finetune") if args.part == "all" else (args.part,)
    for part in parts:
        if part == "errors":
            rows = errors()
            errors_plot(rows, os.path.join(args.out, "errors.png"))
            table = errors_table(rows)
            result: Any = rows
        elif part == "memory":
            result = memory()
            table = memory_table(result)
        else:
            result = finetune()
            table = finetune_table(result)
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(table, flush=True)


if __name__ == "__main__":
    main()
