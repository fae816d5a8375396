"""Rev-MViT-B 16x4 (video): the published sizes, every engine against plain autograd (float64)
over stacks of 1, 2 and 3 blocks with dropout and drop path on, transitions under activation
checkpointing, the planner, input errors."""

from __future__ import annotations

import pytest
import timm
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.layers.multiscale_attention import MultiScaleAttention
from pareprop.models.rev_mvit_video import RevMViTVideoTransition

TOL = 1e-8
NAME = "rev_mvit_base_16x4"
# 4 frames at 32 px: a 2x8x8 first map; kv stride [1, 4, 4] halves spatially at transitions.
TINY = dict(num_frames=4, img_size=32, embed_dim=8, depth=7, transition_blocks=(1, 3),
            kv_stride=(1, 4, 4), num_classes=5, drop_path_rate=0.3, drop_rate=0.1)


def _tiny(**overrides):
    return pareprop.create_model(NAME, **{**TINY, **overrides}).double()


def _check(model, x):
    # Key-norm biases shift every key alike, which softmax ignores: their exact gradient is 0
    # (tests/test_mvit.py), so a relative error would compare rounding noise.
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("norm_k.bias"))
    try:
        report = engine_errors(model, (x,), engines=("reversible", "pareprop"))
    finally:
        model.requires_grad_(True)
    for engine, errors in report.items():
        assert "input:0" in errors and len(errors) > 50
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


def test_published_sizes():
    model = pareprop.create_model(NAME, device="meta")
    # Measured from PySlowFast's own code with CLS_EMBED_ON False (34.9M as published).
    assert sum(p.numel() for p in model.parameters()) == 34_963_120
    assert model.grid_size == (8, 56, 56)  # 25,088 tokens per clip
    assert model.patch_embed.proj.kernel_size == (3, 7, 7)
    assert [len(s.stack.blocks) for s in model.stages] == [1, 1, 10, 1]
    widths = [s.stack.blocks[0].norm1.normalized_shape[0] for s in model.stages]
    assert widths == [96, 192, 384, 768] and model.num_features == 1536
    attns = [s.stack.blocks[0].attn for s in model.stages]
    assert [a.pool_k.stride for a in attns] == [(1, 8, 8), (1, 4, 4), (1, 2, 2), (1, 1, 1)]
    assert [a.num_heads for a in attns] == [1, 2, 4, 8]
    assert all(a.qkv is not None and a.qkv.bias is None and a.q is None for a in attns)
    assert model.stages[1].transition.attn.pool_q.stride == (1, 2, 2)
    assert model.pretrained_cfg["input_size"] == (3, 16, 224, 224)
    assert model.pretrained_cfg["mean"] == (0.45,) * 3
    assert model.pretrained_cfg["std"] == (0.225,) * 3
    assert not any("cls" in n for n, _ in model.named_parameters())
    assert timm.create_model(NAME, device="meta").num_classes == 400


@pytest.mark.parametrize(
    "overrides, sizes",
    [
        (dict(), [1, 1, 3]),  # odd stacks, 1 and 3
        (dict(depth=6), [1, 1, 2]),  # an even stack
    ],
    ids=["stacks113", "stacks112"],
)
def test_every_engine_matches_autograd(float64_seeded, overrides, sizes):
    model = _tiny(**overrides)
    assert [len(s.stack.blocks) for s in model.stages] == sizes
    (x,) = model.example_inputs(2, dtype=torch.float64)
    _check(model, x)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_eval_logits_equal_under_every_engine(float64_seeded, engine):
    model = _tiny(drop_path_rate=0.0, drop_rate=0.0).eval()
    (x,) = model.example_inputs(2, dtype=torch.float64)
    with torch.no_grad():
        ref = model.set_engine("autograd")(x)
        out = model.set_engine(engine)(x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_checkpointed_transitions_keep_gradients_exact(float64_seeded):
    model = _tiny(depth=4, transition_blocks=(2,), drop_path_rate=0.0, drop_rate=0.0)
    (x,) = model.example_inputs(2, dtype=torch.float64)

    def grads(checkpointing):
        model.zero_grad()
        model.set_grad_checkpointing(checkpointing)
        model(x).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-10, atol=1e-12, msg=n)


def test_transition_averages_the_two_streams():
    # PRE_Q_FUSION "avg": only the mean of the streams matters (a concat fusion sees both).
    torch.manual_seed(0)
    t = RevMViTVideoTransition(8, 16, 2, (1, 2, 2), (1, 2, 2)).double().eval()
    a, b = torch.randn(2, 2, 2, 4, 4, 8, dtype=torch.float64).unbind(0)
    out = t(torch.cat([a, b], -1))
    assert out.shape == (2, 2, 2, 2, 16)  # (B, T, H/2, W/2, 2C)
    m = (a + b) / 2
    torch.testing.assert_close(t(torch.cat([m, m], -1)), out)
    assert (t(torch.cat([a, a], -1)) - out).abs().max() > 1e-3


def test_one_pooling_layer_for_images_and_videos():
    # A 3-D kernel of temporal side 1 over one frame is the 2-D layer: same weights, same output.
    torch.manual_seed(0)
    two = MultiScaleAttention(8, 2, pool_kernel=3, stride_q=2, stride_kv=2).double()
    three = MultiScaleAttention(8, 2, pool_kernel=(1, 3, 3), stride_q=(1, 2, 2),
                                stride_kv=(1, 2, 2)).double()
    assert isinstance(two.pool_k, torch.nn.Conv2d) and isinstance(three.pool_k, torch.nn.Conv3d)
    state = {k: v.unsqueeze(2) if k.startswith("pool_") else v
             for k, v in two.state_dict().items()}
    three.load_state_dict(state)
    x = torch.randn(2, 36, 8, dtype=torch.float64)
    out2, hw = two(x, (6, 6))
    out3, thw = three(x, (1, 6, 6))
    assert hw == (3, 3) and thw == (1, 3, 3)
    torch.testing.assert_close(out3, out2, rtol=1e-12, atol=1e-12)


def test_cpu_bf16_pooling_weight_gradient_matches_float64():
    # NOTE [ CPU bf16 depthwise Conv3d ]: the video model's pooling attention (one qkv map, a
    # 2x8x8 map as the tiny model's first stage) under CPU bf16 autocast. With the pooling
    # convolutions fed channels-last views their weight gradients were off by 1 to 1e23.
    torch.manual_seed(0)
    layer = MultiScaleAttention(16, 1, qkv_bias=False, pool_kernel=(3, 3, 3), stride_q=(1, 2, 2),
                                stride_kv=(1, 2, 2), separate_qkv=False)
    x = torch.randn(2, 2 * 8 * 8, 16)

    def pool_grads(dtype, autocast):
        model = layer.to(dtype)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = model(x.to(dtype), (2, 8, 8))
        out.double().square().sum().backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if n.startswith("pool")}

    exact = pool_grads(torch.float64, False)
    bf16 = pool_grads(torch.float32, True)
    assert sorted(bf16) == ["pool_k.weight", "pool_q.weight", "pool_v.weight"]
    for name, g in exact.items():
        error = float((bf16[name] - g).norm() / g.norm())
        assert error < 0.05, f"{name}: relative error {error:.3g}"  # bf16 rounding: about 1e-2


def test_pooling_input_copies_only_cpu_bf16_maps():
    from pareprop.layers.multiscale_attention import pooling_input

    view = torch.randn(2, 4, 4, 4, 8).movedim(-1, 1)  # channels last, as pool_heads makes it
    assert pooling_input(view) is view  # float32: no copy
    image_map = view.bfloat16()[:, :, 0]  # a 2-D map: Conv2d's bf16 gradient is right
    assert pooling_input(image_map) is image_map
    copied = pooling_input(view.bfloat16())
    assert copied.is_contiguous() and torch.equal(copied, view.bfloat16())


def test_planner_takes_the_video_model():
    from pareprop.memory.plan import plan_memory

    kw = {k: v for k, v in TINY.items() if k not in ("drop_path_rate", "drop_rate")}
    plans = {e: plan_memory(NAME, 2, e, device="cpu", **kw) for e in ("autograd", "reversible")}
    assert plans["reversible"].activations < plans["autograd"].activations
    assert plans["reversible"].peak < plans["autograd"].peak


@pytest.mark.parametrize(
    "shape, match",
    [
        ((2, 3, 32, 32), r"expected input \(B, 3, 4, 32, 32\)"),
        ((2, 3, 8, 32, 32), "num_frames=8"),
        ((2, 1, 4, 32, 32), "clips of 4 frames at 32x32"),
    ],
)
def test_wrong_input_says_what_to_do(shape, match):
    model = pareprop.create_model(NAME, **TINY)
    with pytest.raises(ValueError, match=match):
        model(torch.randn(*shape))


def test_config_errors():
    with pytest.raises(ValueError, match="transition_blocks"):
        pareprop.create_model(NAME, device="meta", depth=4, transition_blocks=(3,))
    with pytest.raises(ValueError, match="patch_kernel"):
        pareprop.create_model(NAME, device="meta", patch_kernel=(3, 7))


@pytest.mark.slow
def test_plan_takes_torchvision_mvit_v1_b_plain_and_checkpointed(tmp_path, capsys):
    # Full-width models on fake tensors: about 10 s a plan on one busy core.
    import json

    from pareprop.cli import main

    argv = ["plan", "--models", "mvit_v1_b", "--engines", "plain", "checkpointed",
            "--device", "cpu", "--batch-sizes", "2", "--num-frames", "4", "--img-size", "32",
            "--out", str(tmp_path)]
    assert main(argv) == 0, capsys.readouterr().err
    records = json.loads((tmp_path / "plan.json").read_text())["records"]
    kept = {r["engine"]: r["activations"] for r in records}
    assert set(kept) == {"plain", "checkpointed"}
    assert kept["checkpointed"] < kept["plain"] / 4


def test_torchvision_baseline_checkpointing_keeps_gradients():
    from pareprop.models.torchvision_video import create_torchvision_video

    torch.manual_seed(0)
    model = create_torchvision_video("mvit_v1_b", num_classes=3, num_frames=4, img_size=32)
    (x,) = model.example_inputs(1)

    def grads(enable):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model.eval()(x).sum().backward()  # eval: no stochastic depth, the same both times
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="only mvit_v1_b"):
        create_torchvision_video("mvit_v2_s", num_frames=8)


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_branches_match_autograd(float64_seeded, chunks):
    # The video blocks are Rev-MViT v1's, which split F over samples and G over tokens; with
    # the transitions checkpointed they chunk too, as the stack does.
    model = _tiny()
    model.set_grad_checkpointing()
    pareprop.set_chunking(model, chunks=chunks)
    (x,) = model.example_inputs(3, dtype=torch.float64)
    _check(model, x)
