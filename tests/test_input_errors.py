"""Bad input gets one clear line (and exit status 2 from the CLI), and small cases that used to
crash or be dropped silently work (issue 26, items 6 and 7)."""

import pytest
import timm
import torch

import pareprop
from pareprop.checkpoint import load_model, save_checkpoint
from pareprop.cli.plan import main as plan_main
from pareprop.cli.train import main as train_main

TINY = ["--model-arg", "img_size=8", "--model-arg", "patch_size=2", "--model-arg", "in_chans=1",
        "--model-arg", "embed_dim=16", "--model-arg", "depth=2", "--model-arg", "num_heads=2"]


@pytest.mark.parametrize("arg, message", [
    ("depth=x", "expected ViTConfig.depth to be an integer, got 'x'"),
    ("num_heads=0", "expected ViTConfig.num_heads to be a positive integer, got 0"),
    ("in_chans=0", "expected ViTConfig.in_chans to be a positive integer, got 0"),
    ("drop_path_rate=-0.1", "expected ViTConfig.drop_path_rate to be a rate in [0, 1), got -0.1"),
    ("drop_path_rate=1.5", "expected ViTConfig.drop_path_rate to be a rate in [0, 1), got 1.5"),
])
def test_bad_model_args_are_one_line_and_exit_2(tmp_path, capsys, arg, message):
    rc = train_main([*TINY, "--model-arg", arg, "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_string_depth_in_a_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text('model_kwargs: {depth: "4"}\n')
    rc = train_main(["--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    assert "expected ViTConfig.depth to be an integer, got '4'" in capsys.readouterr().err


@pytest.mark.parametrize("name, kwargs, field", [
    ("rev_vit_tiny_patch4_32", dict(patch_size=0), "patch_size"),
    ("rev_mvitv2_tiny_32", dict(num_heads=0), "num_heads"),
    ("rev_swin_tiny_32", dict(depths=(2, 0)), "depths"),
    ("rev_swin_tiny_32", dict(mlp_ratio=True), "mlp_ratio"),
])
def test_create_model_checks_values(name, kwargs, field):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        pareprop.create_model(name, **kwargs)


def test_plan_refuses_a_budget_no_engine_can_take(capsys):
    rc = plan_main(["--models", "rev_vit_tiny_patch4_32", "--engines", "autograd",
                    "--memory-budgets", "0.5", "--batch-sizes", "2"])
    assert rc == 2 and "has none: add reversible or pareprop" in capsys.readouterr().err


def _vit(**kw):
    return pareprop.create_model("rev_vit_tiny_patch4_32", img_size=8, patch_size=2,
                                 embed_dim=16, depth=2, num_heads=2, num_classes=3, **kw)


def test_memory_budget_on_a_linear_probe():
    model = _vit()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    # Its frozen stack builds no graph (KeyError ('stack', 0) before): nothing to keep or save.
    plan = pareprop.set_memory_budget(model, 0.5, torch.randn(2, 3, 8, 8))
    assert plan.full_bytes == plan.floor_bytes and plan.saving == 0
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model.head.weight.grad is not None


def test_an_engine_set_after_creation_is_saved(tmp_path):
    model = _vit(engine="reversible")
    pareprop.set_engine(model, "pareprop")
    save_checkpoint(tmp_path, model, epoch=0, step=0)
    assert load_model(tmp_path / "last").stack.engine == "pareprop"


@pytest.mark.parametrize("name, kwargs", [
    ("rev_mvitv2_tiny_32", dict(embed_dim=8)),
    ("rev_mvitv2_tiny_32", dict(embed_dim=8, img_size=40, window_size=4, global_stages=0)),
    ("rev_swin_tiny_32", dict(embed_dim=8, depths=(1, 2), num_heads=(1, 2), window=4,
                              patch_size=2, img_size=30)),
])
@pytest.mark.parametrize("engine", ["autograd", "reversible"])
def test_a_batch_of_zero(name, kwargs, engine):
    model = pareprop.create_model(name, num_classes=5, engine=engine, **kwargs)
    x = torch.randn(0, *model.pretrained_cfg["input_size"], requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert out.shape == (0, 5) and x.grad.shape == x.shape


def test_input_error_grammar():
    from pareprop.layers.patch_embed import check_image

    with pytest.raises(ValueError, match=r"\(B, 3, H, W\), an image with 3 channels"):
        check_image(torch.randn(2, 1, 8, 8), 3)  # "a image" before
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\), a 8x8 image with 3 channels"):
        _vit()(torch.randn(2, 1, 8, 8))


def test_pretrained_cfg_overlay_reaches_the_data_config():
    model = timm.create_model("rev_vit_tiny_patch4_32",
                              pretrained_cfg_overlay=dict(mean=(0.1, 0.2, 0.3)))
    assert timm.data.resolve_data_config({}, model=model)["mean"] == (0.1, 0.2, 0.3)
