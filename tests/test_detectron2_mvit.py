"""detectron2's MViTv2 backbone (MViT + FPN), reversible: exact at (1, 0) against a plain
reference that mirrors detectron2's published forward (tests/_detectron2_reference.py,
detectron2 at 02b5c4e2), and every engine's gradients equal autograd's at other couplings.
Tiny configuration: width 8, depth 6 (stages of 2, 2, 1, 1 blocks), windows of 6 over maps of
16 x 24 (zero-padded windows, relative tables resized), 64 x 96 images."""

from __future__ import annotations

import os

import pytest
import torch

import _detectron2_reference as ref
import pareprop
from pareprop.detection.detectron2 import from_detectron2
from pareprop.engine.testing import engine_errors, worst_error

TINY = dict(embed_dim=8, depth=6, num_heads=1, last_block_indexes=(1, 3, 4, 5), img_size=64,
            adaptive_window_size=6, adaptive_kv_stride=2, drop_path_rate=0.0)


def _reference(dtype=torch.float64, drop_path_rate=0.0, seed=0):
    net = ref.MViT(**{**TINY, "drop_path_rate": drop_path_rate})
    return ref.randomize(ref.FPN(net), seed).to(dtype)


def _images(n=2, dtype=torch.float64):
    torch.manual_seed(1)
    return torch.randn(n, 3, 64, 96, dtype=dtype)


def _ours(state, dtype=torch.float64, **kw):
    return from_detectron2(state, "mvitv2_t", dtype=dtype, **{**TINY, **kw})


def _engine_errors(model, x):
    # The key norm's bias gets no gradient (softmax ignores a shift shared by every key): its
    # reference is rounding noise, measured against the largest gradient instead.
    return engine_errors(model, x, noise_floor=1e-8)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equals_detectron2_at_1_0_from_a_zoo_file(tmp_path, dtype, tol):
    model, want, got = ref.zoo_file_outputs(tmp_path, _reference(dtype),
                                            lambda path: _ours(path, dtype=dtype),
                                            _images(dtype=dtype))
    # stage 2 one stack of two blocks; stage 3 a kept transition and a stack; 4 and 5 kept
    assert [len(s.blocks) for s in model.stacks()] == [2, 1]
    assert model.out_channels == 256
    ref.check_pyramid(got, want, [(16, 24), (8, 12), (4, 6), (2, 3), (1, 2)], tol)


@pytest.mark.parametrize("engine", ["autograd", "reversible", "pareprop"])
def test_training_step_at_1_0_equals_detectron2_under_every_engine(engine):
    reference = _reference(drop_path_rate=0.3).train()
    model = _ours(reference.state_dict(), engine=engine, drop_path_rate=0.3).train()
    model.set_grad_checkpointing()  # the kept blocks too: their recomputation draws the same
    x = _images()
    grads = ref.training_step_grads(reference, model, x)
    largest = max(theirs.norm() for _, theirs in grads.values())
    # norm_k's bias: rounding noise, measured against the largest gradient
    for name, (ours, theirs) in grads.items():
        norm = theirs.norm()
        err = (ours - theirs).norm() / (norm if norm >= 1e-8 * largest else largest)
        assert err < 1e-10, name


@pytest.mark.parametrize("coupling,setup", [((0.0, 1.0), "plain"), ((1.0, 0.8), "checkpointed"),
                                            ((0.3, 0.5), "chunked")])
def test_every_engine_equals_autograd_at_other_couplings(coupling, setup):
    model = _ours(None, drop_path_rate=0.2, coupling=coupling, tolerance=None)
    ref.randomize(model)
    if setup != "plain":
        model.set_grad_checkpointing()
    if setup == "chunked":
        pareprop.set_chunking(model, chunks=2)
    engine, key, err = worst_error(_engine_errors(model, _images(n=3)))
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_schedule_and_guard_move_every_stack():
    model = _ours(None, drop_path_rate=0.2)
    ref.randomize(model)
    assert len(model.precision_guard.stacks) == 2
    schedule = pareprop.CouplingSchedule(model, "linear", steps=2)
    schedule.step()
    assert all(b._alpha_value == 0.5 for s in model.stacks() for b in s.blocks)
    engine, key, err = worst_error(_engine_errors(model, _images()))
    assert all(r is not None and r.beta == 0.5 for r in model.precision_guard.reports)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_pyslowfast_imagenet_file_loads_the_blocks(tmp_path):
    # MViTv2_*_in1k.pyth: a torch file with "model_state" in the classifier's names; it has
    # query pooling only where queries stride, a class token, a final norm and a head.
    reference = _reference()
    body = {k[len("bottom_up."):]: v for k, v in reference.state_dict().items()
            if k.startswith("bottom_up.blocks.") or k.startswith("bottom_up.patch_embed.")}
    body = {k: v for k, v in body.items()
            if not (k.startswith(("blocks.0.", "blocks.1.")) and ".pool_q." in k)}
    body.update({"cls_token": torch.zeros(1, 1, 8, dtype=torch.float64),
                 "norm.weight": torch.ones(64, dtype=torch.float64),
                 "head.projection.weight": torch.zeros(5, 64, dtype=torch.float64)})
    path = tmp_path / "MViTv2_T_in1k.pyth"
    torch.save({"model_state": body, "epoch": 300, "cfg": "MVIT: ..."}, path)
    model = _ours(os.fspath(path))
    report = model.load_report
    assert report.layout == "imagenet"
    assert report.unused == ["cls_token", "head.projection.weight", "norm.weight"]
    assert "bottom_up.blocks.0.attn.pool_q.weight" in report.left_at_init
    assert all(k.startswith(("fpn_", "bottom_up.scale", "bottom_up.blocks.0.attn.pool_q",
                             "bottom_up.blocks.1.attn.pool_q")) for k in report.left_at_init)
    own = model.state_dict()
    assert all(torch.equal(own["bottom_up." + k], v) for k, v in body.items()
               if k not in report.unused)
