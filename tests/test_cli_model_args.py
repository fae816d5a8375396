"""Model arguments of converted models through ``pareprop train`` and ``pareprop eval``: bad
keys and values refused in one line (exit 2), arguments the run would override refused, a
head eval would score at random refused, and a ``--model`` that contradicts a checkpoint."""

from __future__ import annotations

import re

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

import pareprop
from pareprop.cli import main as cli
from pareprop.trainer import TrainConfig

SOURCE = "vit_tiny_patch16_224"
TINY = dict(img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2)
ARGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"c{c}").mkdir()
        for i in range(2):
            pixels = rng.integers(0, 256, size=(10, 10, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """timm's tiny ViT of 3 classes, as a safetensors file in timm's layout."""
    torch.manual_seed(0)
    vit = timm.create_model(SOURCE, num_classes=3, **TINY)
    path = tmp_path_factory.mktemp("w") / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(path))
    return path


def _one_line_error(capsys, rc):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "error" in lines[0], err
    return lines[0]


BAD = {
    "foo=1": "takes no model argument 'foo'",
    "depth=two": "cannot build timm's vit_tiny_patch16_224 with .*depth='two'",
    "coupling=[0.5]": "coupling",
}


@pytest.mark.parametrize("arg", list(BAD))
def test_train_refuses_bad_model_args_of_a_converted_model(arg, tmp_path, capsys):
    rc = cli(["train", "--convert-from", SOURCE, "--from-scratch", *ARGS, "--model-arg", arg,
              "--epochs", "1", "--max-steps", "1", "--no-progress", "--out", str(tmp_path)])
    line = _one_line_error(capsys, rc)
    assert re.search(BAD[arg], line), line


@pytest.mark.parametrize("arg", list(BAD))
def test_eval_refuses_bad_model_args_of_a_converted_model(arg, folder, weights, capsys):
    rc = cli(["eval", "--model", f"converted:{SOURCE}", "--checkpoint", str(weights),
              "--data-dir", str(folder), "--workers", "0", "--no-progress", *ARGS,
              "--model-arg", arg])
    line = _one_line_error(capsys, rc)
    assert "Traceback" not in line


@pytest.mark.parametrize("name, kwargs, message", [
    ("converted_tv_swin", dict(source="swin_t", depths=2), "cannot build torchvision's swin_t"),
    ("converted_swin3d", dict(source="swin3d_t", num_frames=0), "num_frames to be a positive"),
    ("converted_tv_mvit", dict(source="mvit_v2_s", num_frames=0),
     "num_frames to be a positive"),
    ("converted_tv_mvit", dict(source="mvit_v2_s", max_run=0), "max_run to be a positive"),
    ("converted_mvitv2", dict(source="mvitv2_tiny", depths=2), "cannot build timm's mvitv2"),
    ("converted_mvitv2", dict(source="mvitv2_tiny", img_size=63, embed_dim=16, depths=[1, 2],
                              num_heads=[1, 2]), "img_size=63 but cannot run at it"),
    ("converted_vit", dict(source=SOURCE, coupling=[0.5]), r"coupling=\[alpha, beta\]"),
    ("converted_swin3d", dict(source="swin3d_t", frame_stride=0), "frame_stride an int >= 1"),
    ("converted_tv_mvit", dict(source="mvit_v2_s", mean=[0.5, 0.5]), "mean with one number"),
])
def test_bad_model_args_of_each_family_are_one_line_value_errors(name, kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        pareprop.create_model(name, **kwargs)
    assert "\n" not in str(caught.value)


def test_converted_video_sources_take_the_video_data_config():
    # frame_stride, mean and std, as a registered video model takes them, reach the one video
    # data config (and so the clips of train and eval).
    from pareprop.data import video_data_config

    small = dict(num_frames=4, img_size=32, embed_dim=16, max_run=1)
    model = pareprop.create_model("converted_tv_mvit", source="mvit_v2_s", frame_stride=3,
                                  mean=[0.1, 0.2, 0.3], std=[0.4, 0.5, 0.6], **small)
    config = video_data_config(model)
    assert config["frame_stride"] == 3
    assert config["mean"] == pytest.approx([0.1, 0.2, 0.3])
    assert config["std"] == pytest.approx([0.4, 0.5, 0.6])
    assert model.model_kwargs["frame_stride"] == 3  # a checkpoint rebuilds it so
    swin = pareprop.create_model("converted_swin3d", source="swin3d_t", frame_stride=5,
                                 num_frames=4, img_size=32, embed_dim=16, depths=[2, 2],
                                 num_heads=[1, 2])
    assert video_data_config(swin)["frame_stride"] == 5


def test_model_args_the_run_would_override_are_refused():
    base = dict(convert_from=SOURCE, from_scratch=True, progress=False)
    with pytest.raises(ValueError, match="engine=autograd and --engine reversible"):
        TrainConfig(model_kwargs={**TINY, "engine": "autograd"}, **base)
    TrainConfig(model_kwargs={**TINY, "engine": "autograd"}, engine="autograd", **base)
    with pytest.raises(ValueError, match="coupling schedule sets the coupling"):
        TrainConfig(model_kwargs={**TINY, "coupling": [0, 1]}, **base)
    with pytest.raises(ValueError, match="pretrained=true and --from-scratch"):
        TrainConfig(model_kwargs={**TINY, "pretrained": True}, **base)


def test_eval_refuses_a_head_that_is_not_the_files(folder, weights, capsys):
    # The file's head has 3 classes: with 5, the loader left it out and a random one scored.
    rc = cli(["eval", "--model", f"converted:{SOURCE}", "--checkpoint", str(weights),
              "--data-dir", str(folder), "--workers", "0", "--no-progress", *ARGS,
              "--model-arg", "num_classes=5"])
    line = _one_line_error(capsys, rc)
    assert "num_classes=5" in line and "3 classes" in line
    rc = cli(["eval", "--model", f"converted:{SOURCE}", "--checkpoint", str(weights),
              "--data-dir", str(folder), "--workers", "0", "--no-progress", *ARGS,
              "--model-arg", "num_classes=3"])
    assert rc == 0, capsys.readouterr().err


def test_eval_refuses_a_model_the_checkpoint_does_not_name(folder, tmp_path, capsys):
    from pareprop.checkpoint import save_checkpoint

    model = pareprop.create_model("converted_vit", source=SOURCE, num_classes=3, **TINY)
    save_checkpoint(tmp_path / "run", model, epoch=1, step=1)
    run = str(tmp_path / "run")
    common = ["--checkpoint", run, "--data-dir", str(folder), "--workers", "0", "--no-progress"]
    for other in ("rev_vit_tiny_patch4_32", "converted:deit_tiny_patch16_224"):
        line = _one_line_error(capsys, cli(["eval", "--model", other, *common]))
        assert other in line and "name two models" in line
    for same in ("converted_vit", f"converted:{SOURCE}"):
        assert cli(["eval", "--model", same, *common]) == 0, capsys.readouterr().err


def test_plan_and_eval_errors_speak_their_own_flags(folder, monkeypatch, capsys):
    # Neither command has --convert-from, --pretrained-file or --from-scratch.
    train_flags = ("--convert-from", "--pretrained-file", "--from-scratch")
    for argv in (["plan", "--models", "converted:no_such_vit", "--batch-sizes", "2",
                  "--device", "cpu"],
                 ["eval", "--model", "converted:no_such_vit", "--pretrained", "--data-dir",
                  str(folder)]):
        line = _one_line_error(capsys, cli(argv))
        assert "converted:no_such_vit" in line
        assert not any(flag in line for flag in train_flags), line
    real = timm.create_model

    def hub(name, pretrained=False, **kwargs):  # timm's weights: its own 192-wide ViT-Ti
        if pretrained:
            weights = real(name, **{**kwargs, "embed_dim": 192, "num_heads": 3}).state_dict()
            real(name, **kwargs).load_state_dict(weights)  # raises as timm's loader does
        return real(name, **kwargs)

    import importlib

    timm_pretrained = importlib.import_module("pareprop.convert.timm_pretrained")
    monkeypatch.setattr(timm_pretrained.timm, "create_model", hub)
    line = _one_line_error(capsys, cli([
        "eval", "--model", f"converted:{SOURCE}", "--pretrained", "--data-dir", str(folder),
        *ARGS]))
    assert "embed_dim" in line and "--checkpoint PATH" in line
    assert not any(flag in line for flag in train_flags), line


def test_eval_refuses_an_engine_model_arg_that_engine_overrides(folder, weights, capsys):
    common = ["eval", "--model", f"converted:{SOURCE}", "--checkpoint", str(weights),
              "--data-dir", str(folder), "--workers", "0", "--no-progress", *ARGS]
    line = _one_line_error(capsys, cli([*common, "--model-arg", "engine=autograd",
                                        "--engine", "pareprop"]))
    assert "engine=autograd and --engine pareprop" in line
    assert cli([*common, "--model-arg", "engine=pareprop", "--engine", "pareprop",
                "--model-arg", "num_classes=3"]) == 0


def test_eval_refuses_another_head_for_a_registered_model_too(folder, tmp_path, capsys):
    from test_pretrained import VIT, _slowfast_file, slowfast_vit_state

    # The folder's 3 classes and a file of 5: the old code scored a random 3-class head.
    path = _slowfast_file(tmp_path / "REV_VIT.pyth", slowfast_vit_state(classes=5))
    args = [f"--model-arg={k}={v}" for k, v in {**VIT, "num_classes": 3}.items()]
    line = _one_line_error(capsys, cli([
        "eval", "--model", "rev_vit_base_patch16_224", "--checkpoint", str(path),
        "--data-dir", str(folder), "--workers", "0", "--no-progress", *args]))
    assert "num_classes=3" in line and "5 classes" in line
