"""Fine-tuning from published weights: every family's group_matcher orders its layers, timm's
optimizer factory gives layer-wise learning-rate factors, the initial weights keep a fresh
head, and `pareprop train --pretrained-file` starts from them."""

from __future__ import annotations

import math

import pytest
import torch
from timm.models import group_parameters

import pareprop
from pareprop.trainer.finetune import create_finetune_optimizer, load_initial_weights

TINY = {
    "rev_vit_tiny_patch4_32": dict(depth=3),
    "rev_mvit_base": dict(img_size=32, embed_dim=8, depth=6, transition_blocks=(1, 3)),
    "rev_mvitv2_tiny_32": dict(embed_dim=8),
    "rev_swin_tiny_32": dict(embed_dim=8, depths=(1, 2), num_heads=(1, 2), window=4,
                             img_size=16, patch_size=2),
    "rev_roberta_small": dict(depth=3, embed_dim=16, num_heads=2, vocab_size=50, mlp_dim=32,
                              max_position_embeddings=16, example_seq_len=8),
}


def _layers(model):
    return group_parameters(model, model.group_matcher(coarse=False), reverse=True)


@pytest.mark.parametrize("name", list(TINY))
def test_group_matcher_orders_every_block(name):
    model = pareprop.create_model(name, **TINY[name])
    layer = _layers(model)
    names = [n for n, _ in model.named_parameters()]
    assert set(layer) == set(names)
    top = max(layer.values())
    stem = [n for n in names if layer[n] == 0]
    assert stem and all(not n.startswith(("head", "norm")) for n in stem)
    assert all(layer[n] == top for n in names if n.startswith("head"))
    # The blocks' parameters are registered in depth order in every family.
    blocks = [layer[n] for n in names if 0 < layer[n] < top and not n.startswith("norm")]
    # timm's (99999,) suffix puts the final norm in the last block's group.
    assert all(layer[n] == max(blocks) for n in names if n.startswith("norm."))
    assert blocks == sorted(blocks) and len(set(blocks)) >= 3


def test_layer_decay_scales_learning_rates():
    model = pareprop.create_model("rev_mvit_base", **TINY["rev_mvit_base"])
    opt = create_finetune_optimizer(model, lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    scales = {}
    for g in opt.param_groups:
        for p in g["params"]:
            scales[p] = g["lr_scale"]
    by_name = {n: scales[p] for n, p in model.named_parameters()}
    assert by_name["head.weight"] == 1.0
    assert by_name["patch_embed.proj.weight"] == pytest.approx(0.5 ** max(_layers(model).values()))
    t1 = by_name["stages.1.transition.attn.q.weight"]
    b1 = by_name["stages.1.stack.blocks.0.attn.q.weight"]
    assert by_name["pos_embed"] < t1 < b1 < by_name["norm.weight"] <= 1.0
    decays = {n: g["weight_decay"] for g in opt.param_groups for n, p in model.named_parameters()
              if any(p is q for q in g["params"])}
    assert decays["pos_embed"] == 0 and decays["stages.1.stack.blocks.0.norm1.bias"] == 0
    assert decays["head.weight"] == 0.05
    with pytest.raises(ValueError, match="layer_decay"):
        create_finetune_optimizer(model, lr=1e-3, layer_decay=1.5)


def test_timm_scheduler_applies_the_scales():
    from timm.scheduler import CosineLRScheduler

    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2)
    opt = create_finetune_optimizer(model, lr=1e-3, layer_decay=0.5)
    sched = CosineLRScheduler(opt, t_initial=10, warmup_t=0)
    sched.step(0)
    lrs = sorted({round(g["lr"], 12) for g in opt.param_groups})
    assert lrs[-1] == pytest.approx(1e-3) and lrs[0] == pytest.approx(1e-3 * 0.5**3)


def test_initial_weights_keep_a_fresh_head(tmp_path):
    from test_pretrained import VIT, _slowfast_file, slowfast_vit_state

    state = slowfast_vit_state()
    path = _slowfast_file(tmp_path / "REV_VIT.pyth", state)
    model = pareprop.create_model("rev_vit_base_patch16_224", **{**VIT, "num_classes": 10})
    report = load_initial_weights(model, path)
    assert report.dropped_head and model.head.out_features == 10
    assert torch.equal(model.pos_embed, state["pos_embed"])
    with pytest.raises(pareprop.PretrainedError, match="no published weights"):
        load_initial_weights(pareprop.create_model("rev_vit_tiny_patch4_32"))


DIGITS = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=2)


def _digits_file(tmp_path):
    from test_pretrained import _slowfast_file, slowfast_vit_state

    # A published-layout file at digits size, with a 1000-class head like the real ones.
    state = slowfast_vit_state(C=32, depth=2, patch=2, img=8, classes=1000, chans=1)
    return _slowfast_file(tmp_path / "REV_VIT_digits.pyth", state), state


def test_trainer_starts_from_the_file_with_a_fresh_head(tmp_path):
    from pareprop.trainer import TrainConfig, Trainer

    path, state = _digits_file(tmp_path)
    cfg = TrainConfig(model="rev_vit_base_patch16_224", model_kwargs=dict(DIGITS),
                      dataset="digits", pretrained_file=str(path), layer_decay=0.75,
                      epochs=1, max_steps=1, out=str(tmp_path / "run"), progress=False)
    trainer = Trainer(cfg)
    model = trainer.model
    assert model.head.out_features == 10
    assert torch.equal(model.pos_embed, state["pos_embed"])
    assert torch.equal(model.norm.weight, state["norm.weight"])
    qkv = torch.cat([state[f"rev_backbone.layers.1.F.attn.{n}.weight"] for n in "qkv"])
    assert torch.equal(model.stack.blocks[1].attn.qkv.weight, qkv)
    scales = sorted({g["lr_scale"] for g in trainer.optimizer.param_groups})
    assert scales[-1] == 1.0 and scales[0] == pytest.approx(0.75**3)


def test_cli_fine_tunes_from_a_file_on_digits(tmp_path):
    import json

    from pareprop.cli import main as cli

    path, _ = _digits_file(tmp_path)
    args = [f"--model-arg={k}={v}" for k, v in DIGITS.items()]
    rc = cli(["train", "--model", "rev_vit_base_patch16_224", *args, "--dataset", "digits",
              "--pretrained-file", str(path), "--num-classes", "10", "--layer-decay", "0.75",
              "--epochs", "1", "--max-steps", "2", "--out", str(tmp_path / "run"),
              "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records and all(math.isfinite(r.get("train_loss", 0.0)) for r in records)
