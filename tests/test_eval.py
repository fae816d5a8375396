"""``pareprop eval`` on a tiny ImageFolder: its top-1/top-5 equal a direct computation with an
independent reference forward and a hand-built transform; every input path works."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms

import pareprop
from pareprop.checkpoint import load_checkpoint
from pareprop.cli import main as cli
from pareprop.evaluate import evaluate

# Shared with the published-weights tests (pytest puts tests/ on sys.path).
from test_pretrained import VIT, _slowfast_file, reference_slowfast_vit, slowfast_vit_state

CLASSES = 6
ARGS = [f"--model-arg={k}={v}" for k, v in {**VIT, "num_classes": CLASSES}.items()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (root / f"n{c:08d}").mkdir()
        for i in range(3):
            pixels = rng.integers(0, 256, size=(40 + 3 * i, 37, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"n{c:08d}" / f"img{i}.png")
    return root


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    state = slowfast_vit_state(classes=CLASSES, seed=3)
    return _slowfast_file(tmp_path_factory.mktemp("w") / "REV_VIT.pyth", state), state


def _direct(folder, state):
    """top-1/top-5 by hand: the published evaluation transform at 32 px (crop_pct 1.0 below
    224 px), the reference forward, argmax."""
    tf = transforms.Compose([
        transforms.Resize(32, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(32),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    top1 = top5 = n = 0
    for c, d in enumerate(sorted(p for p in folder.iterdir())):
        for f in sorted(d.iterdir()):
            x = tf(Image.open(f).convert("RGB"))[None]
            logits = reference_slowfast_vit(state, x, heads=2)[0]
            top1 += int(logits.argmax() == c)
            top5 += int(c in logits.topk(5).indices)
            n += 1
    return 100 * top1 / n, 100 * top5 / n, n


def test_cli_top1_matches_a_direct_computation(folder, weights, tmp_path, capsys):
    path, state = weights
    out = tmp_path / "result.json"
    rc = cli(["eval", "--model", "rev_vit_base_patch16_224", "--checkpoint", str(path),
              "--data-dir", str(folder), "--workers", "0", "--batch-size", "5",
              "--json", str(out), "--no-progress", *ARGS])
    assert rc == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    top1, top5, n = _direct(folder, state)
    assert result["images"] == n == 18 and result["classes"] == CLASSES
    assert result["top1"] == pytest.approx(top1) and result["top5"] == pytest.approx(top5)
    assert 0 < result["top5"] < 100  # the check can tell right from wrong
    assert result["data_config"]["interpolation"] == "bicubic"


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_every_engine_gives_the_same_accuracy(folder, weights, engine):
    path, state = weights
    model = pareprop.create_model("rev_vit_base_patch16_224", **{**VIT, "num_classes": CLASSES})
    pareprop.load_pretrained(model, path)
    result = evaluate(model, str(folder), engine=engine, workers=0, progress=False)
    assert result["engine"] == engine
    assert result["top1"] == pytest.approx(_direct(folder, state)[0])


def test_bf16_and_a_pareprop_checkpoint(folder, weights, tmp_path, capsys):
    from pareprop.checkpoint import save_checkpoint

    path, _ = weights
    model = pareprop.create_model("rev_vit_base_patch16_224", **{**VIT, "num_classes": CLASSES})
    pareprop.load_pretrained(model, path)
    save_checkpoint(tmp_path / "run", model, epoch=1, step=1)
    rc = cli(["eval", "--checkpoint", str(tmp_path / "run" / "last"), "--data-dir", str(folder),
              "--workers", "0", "--amp", "bf16", "--engine", "pareprop", "--no-progress"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["amp"] == "bf16" and result["engine"] == "pareprop" and result["images"] == 18


def test_clear_errors(folder, weights, capsys):
    path, _ = weights
    base = ["eval", "--model", "rev_vit_base_patch16_224", "--data-dir", str(folder),
            "--workers", "0", "--no-progress"]
    # The file's 6-class head is dropped for a 1000-class model; the folder then does not fit.
    assert cli([*base, "--checkpoint", str(path), *ARGS[:-1]]) == 2
    assert "6 class folders but the model predicts 1000" in capsys.readouterr().err
    assert cli([*base, "--checkpoint", str(folder / "absent.pth"), *ARGS]) == 2
    err = capsys.readouterr().err
    assert "absent.pth" in err and "does not exist" in err  # issue 39.6
    assert cli(["eval", "--checkpoint", str(path), "--data-dir", str(folder)]) == 2
    assert "--model NAME is needed" in capsys.readouterr().err


def _split_folder(root, classes=3, per_class=(6, 4)):
    rng = np.random.default_rng(1)
    for split, n in zip(("train", "val"), per_class):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                # a class-coloured tint, so a trained model gets some right
                pixels = rng.integers(0, 245, size=(30 + 2 * i, 27, 3), dtype=np.uint8)
                pixels[..., c] += 10
                Image.fromarray(pixels).save(d / f"{i}.png")
    return root


def test_trainer_and_eval_agree_on_a_checkpoint(tmp_path, capsys):
    # Issue 34.2: the trainer validated with ImageNet statistics (8/7 resize, bilinear) and
    # eval with the model's pretrained_cfg (CIFAR statistics, bicubic, crop 1.0).
    folder = _split_folder(tmp_path / "data")
    run = tmp_path / "run"
    model_args = [f"--model-arg={k}={v}" for k, v in
                  dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2).items()]
    assert cli(["train", "--dataset", str(folder), *model_args, "--epochs", "2",
                "--batch-size", "6", "--lr", "3e-3", "--warmup-epochs", "0",
                "--no-progress", "--out", str(run)]) == 0
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    val_acc = [r for r in records if r["type"] == "epoch"][-1]["val_acc"]
    saved = load_checkpoint(run / "last", train_state=False).meta["data_config"]
    assert saved["mean"] == pytest.approx([0.485, 0.456, 0.406])  # from scratch: the data's
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert cli(["eval", "--checkpoint", str(run / "last"), "--data-dir", str(folder / "val"),
                "--workers", "0", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["data_config"] == saved
    assert result["images"] == 12 and result["top1"] == pytest.approx(100 * val_acc)


TINY_VIT = {"depth": 2, "img_size": 32, "patch_size": 8, "num_classes": CLASSES}


def test_a_converted_source_by_name_evaluates_as_its_source(folder, tmp_path, capsys):
    # converted:SOURCE with SOURCE's own weight file: at (1, 0) the converted model's logits are
    # the source's, so its accuracy is the source's own (evaluated directly, unconverted).
    timm = pytest.importorskip("timm")
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", **TINY_VIT).eval()
    path = tmp_path / "vit_tiny.safetensors"
    save_file(source.state_dict(), str(path))
    # timm keeps the 224-px cfg of the name; the converted model records the size it takes.
    source.pretrained_cfg = {**source.pretrained_cfg, "input_size": (3, 32, 32)}
    want = evaluate(source, str(folder), batch_size=5, workers=0, progress=False)
    args = [f"--model-arg={k}={v}" for k, v in TINY_VIT.items()]
    rc = cli(["eval", "--model", "converted:vit_tiny_patch16_224", "--checkpoint", str(path),
              "--data-dir", str(folder), "--workers", "0", "--batch-size", "5",
              "--no-progress", *args])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["top1"], result["top5"]) == (want["top1"], want["top5"])
    assert 0 < result["top1"] < 100  # the check can tell right from wrong


def test_a_converted_source_offline_is_refused_in_one_line(folder, monkeypatch, capsys):
    timm = pytest.importorskip("timm")
    real = timm.create_model

    def offline(name, pretrained=False, **kwargs):
        if pretrained:
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return real(name, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline)
    args = [f"--model-arg={k}={v}" for k, v in TINY_VIT.items()]
    rc = cli(["eval", "--model", "converted:vit_tiny_patch16_224", "--pretrained",
              "--data-dir", str(folder), "--workers", "0", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "converted:vit_tiny_patch16_224 --pretrained" in err and "--checkpoint PATH" in err
    assert "--pretrained-file" not in err and "--from-scratch" not in err
