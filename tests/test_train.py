"""`pareprop train` and the trainer: engine agreement, exact resume, failures, the CLI."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import pareprop
from pareprop.checkpoint import load_checkpoint, load_model
from pareprop.cli.train import main, resolve_config
from pareprop.trainer import TIMING_KEYS, TrainConfig, Trainer, param_groups

MODEL = "rev_vit_tiny_patch4_32"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=2)
TINY_ARGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]


def _cfg(tmp_path, **kw):
    base = dict(
        model=MODEL,
        model_kwargs=dict(TINY, drop_path_rate=0.1),
        epochs=3,
        batch_size=256,
        lr=2e-3,
        warmup_epochs=1,
        out=str(tmp_path),
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _epochs(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS}
        for r in records
        if r["type"] == "epoch"
    ]


def test_training_losses_agree_across_engines(tmp_path):
    # Acceptance: same seed, autograd against reversible (and pareprop), 20 steps, float32.
    losses = {}
    for engine in ("autograd", "reversible", "pareprop"):
        cfg = _cfg(tmp_path / engine, engine=engine, epochs=1, batch_size=16, max_steps=20)
        trainer = Trainer(cfg)
        trainer.fit()
        losses[engine] = torch.tensor(trainer.step_losses)
    assert len(losses["autograd"]) == 20
    assert losses["autograd"][-1] < losses["autograd"][0]  # it trains
    for engine in ("reversible", "pareprop"):
        diff = (losses[engine] - losses["autograd"]).abs().max().item()
        assert diff < 1e-5, f"{engine}: max loss difference {diff}"


def test_resume_gives_the_same_metrics(tmp_path):
    # Dropout-like randomness (drop-path) and augmentation are on, so RNG state matters.
    full = _cfg(tmp_path / "full")
    Trainer(full).fit()
    part = tmp_path / "part"
    Trainer(_cfg(part, stop_after_epochs=1)).fit()
    assert len(_epochs(part)) == 1
    Trainer(_cfg(part, resume=str(part / "last"))).fit()
    assert _epochs(part) == _epochs(tmp_path / "full")
    a, b = load_model(tmp_path / "full" / "last"), load_model(part / "last")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert load_checkpoint(part / "last").step == load_checkpoint(tmp_path / "full" / "last").step


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch, capsys):
    real, calls = F.cross_entropy, []

    def poisoned(logits, target, **kw):
        loss = real(logits, target, **kw)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) > 7:  # epoch 1 has 6 steps: NaN in epoch 2
                return loss * float("nan")
        return loss

    monkeypatch.setattr(F, "cross_entropy", poisoned)
    out = tmp_path / "run"
    argv = ["--model", MODEL, *TINY_ARGS, "--epochs", "3", "--batch-size", "256"]
    rc = main(argv + ["--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "loss is nan at epoch 2" in err and "last good checkpoint" in err
    ck = load_checkpoint(out / "last")
    assert ck.epoch == 1 and ck.step == 6
    weights = load_model(out / "last").state_dict()
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("amp, advice", [("bf16", "--amp none (float32) instead of bf16"),
                                          ("none", "keep --clip-grad\n")])
def test_non_finite_stop_advises_a_wider_type_than_the_runs(tmp_path, monkeypatch, capsys,
                                                           amp, advice):
    # A bf16 run was told to train "with --amp none/bf16 instead of fp16".
    real = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **kw: real(*a, **kw) * float("nan"))
    argv = ["--model", MODEL, *TINY_ARGS, "--epochs", "1", "--batch-size", "256", "--amp", amp,
            "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "loss is nan" in err and advice in err and "fp16" not in err


def test_cli_end_to_end_with_config_file_and_eval_only(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {MODEL}\nmodel_kwargs: {json.dumps(TINY)}\nepochs: 5\nbatch_size: 256\n"
        "lr: 0.002\nengine: pareprop\n"
    )
    out = tmp_path / "out"
    assert main(["--config", str(config), "--epochs", "1", "--out", str(out), "--no-progress"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["epochs"] == 1 and saved["engine"] == "pareprop" and saved["lr"] == 0.002
    (epoch,) = _epochs(out)
    assert epoch["epoch"] == 1 and epoch["step"] == 6
    assert "done: 1 epoch(s)" in capsys.readouterr().err
    model = pareprop.create_model(MODEL, **TINY)
    ref = load_model(out / "best")
    assert type(ref) is type(model) and ref.num_classes == 10

    rc = main(["--resume", str(out / "last"), "--eval-only", "--out", str(out), "--no-progress"])
    assert rc == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["type"] == "eval" and last["val_acc"] == epoch["val_acc"]


def test_boolean_options_are_switches_and_flags_override_the_file(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"augment": False, "epochs": 7, "lr": 0.1}))
    cfg = resolve_config(["--config", str(cfg_file), "--augment", "--lr", "0.01"])
    assert cfg.augment is True and cfg.epochs == 7 and cfg.lr == 0.01
    cfg = resolve_config(["--no-augment", "--download", "--clip-grad", "0"])
    assert cfg.augment is False and cfg.download is True and cfg.clip_grad is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--amp", "fp8"], "invalid choice"),
        (["--download", "False"], "unrecognized arguments: False"),
        (["--epochs", "0"], "expected epochs >= 1"),
        (["--model", "rev_vit_tiny_patch4"], "did you mean rev_vit_tiny_patch4_32"),
        (["--engine", "magic"], "expected --engine one of autograd, reversible, pareprop"),
        (["--eval-only"], "--eval-only needs a checkpoint"),
        (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a CUDA device"),
        (["--batch-size", "10", "--grad-accum", "3"], "divisible by processes x --grad-accum"),
        (["--model-arg", "depth"], "expected --model-arg KEY=VALUE"),
        (["--model-arg", "depthh=3"], "depthh"),
    ],
)
def test_bad_flags(tmp_path, capsys, argv, message):
    base = ["--model", MODEL, *TINY_ARGS, "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_from_files(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("epochs: 2\nlearning_rate: 0.1\n")
    assert main(["--config", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert "unknown training option(s) learning_rate" in err and "lr" in err
    assert main(["--resume", str(tmp_path / "nothing"), "--no-progress"]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    rc = main(["--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", MODEL, *TINY_ARGS])
    assert rc == 2 and "--download" in capsys.readouterr().err


def test_no_weight_decay_on_norms_biases_and_position_embeddings():
    model = pareprop.create_model(MODEL, **TINY)
    decay, no_decay = param_groups(model, 0.05)
    ids = {id(p) for p in no_decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in ids}
    assert no_decay["weight_decay"] == 0 and decay["weight_decay"] == 0.05
    assert set(model.no_weight_decay()) <= names
    assert all(model.get_parameter(n).ndim <= 1 or n in model.no_weight_decay() for n in names)
    assert all(p.ndim >= 2 for p in decay["params"])


@pytest.mark.parametrize("name", ["digits", "cifar10_rev_vit_tiny", "cifar10_rev_mvitv2_tiny"])
def test_recipes_parse_and_build(name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = resolve_config(["--config", os.path.join(root, "configs", f"{name}.yaml")])
    model = pareprop.create_model(cfg.model, **cfg.model_kwargs)
    expected = (1, 8, 8) if cfg.dataset == "digits" else (3, 32, 32)
    assert tuple(model.pretrained_cfg["input_size"]) == expected
    if name == "digits":  # the file spells out the defaults of a bare `pareprop train`
        assert cfg == TrainConfig(out=cfg.out)


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch, capsys, clip):
    # A finite loss whose step still ruins the weights (the last step of epoch 2): with
    # clipping the gradient norm catches it before the step; without, the validation loss
    # does, before the NaN weights could replace the good epoch-1 checkpoint as 'last'.
    real, calls = torch.optim.AdamW.step, []

    def poisoned(self, *args, **kwargs):
        if len(calls) == 11:  # 6 steps per epoch: the 12th step ends epoch 2
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.fill_(float("inf"))
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    out = tmp_path / "run"
    argv = ["--model", MODEL, *TINY_ARGS, "--epochs", "3", "--batch-size", "256"]
    rc = main(argv + ["--clip-grad", clip, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "last good checkpoint" in err
    ck = load_checkpoint(out / "last")
    assert ck.epoch == 1 and ck.step == 6
    assert all(torch.isfinite(t).all() for t in load_model(out / "last").state_dict().values())


def test_config_file_values_are_type_checked(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 1e-3\nepochs: 2\nclip_grad: 0\n")  # YAML reads 1e-3 as a string
    cfg = resolve_config(["--config", str(cfg_file)])
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float) and cfg.clip_grad is None
    for text, message in [
        ('augment: "false"\n', "expected augment true or false"),
        ("epochs: 2.5\n", "expected epochs to be an integer"),
        ("lr: fast\n", "expected lr to be a number"),
        ("model_kwargs: 3\n", "expected model_kwargs to be a mapping"),
    ]:
        cfg_file.write_text(text)
        with pytest.raises(ValueError, match=message):
            resolve_config(["--config", str(cfg_file)])


def test_model_arg_changes_the_preset_instead_of_replacing_it(tmp_path):
    from pareprop.trainer import PRESETS

    preset = PRESETS[(MODEL, "digits")]
    cfg = resolve_config(["--model-arg", "depth=2"])
    assert cfg.model_kwargs == {**preset, "depth": 2}
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model_kwargs: {embed_dim: 32}\n")
    cfg = resolve_config(["--config", str(cfg_file), "--model-arg", "depth=2"])
    assert cfg.model_kwargs == {"embed_dim": 32, "depth": 2}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--label-smoothing", "2"], "expected label_smoothing in [0, 1]"),
        (["--warmup-epochs", "-1"], "expected warmup_epochs >= 0"),
        (["--weight-decay", "-1"], "expected weight_decay >= 0"),
        (["--clip-grad", "-1"], "expected clip_grad > 0"),
        (["--lr", "nan"], "expected a positive learning rate"),
        (["--max-steps", "0"], "expected max_steps >= 1"),
        (["--stop-after-epochs", "0"], "expected stop_after_epochs >= 1"),
        (["--device", "gpu0"], "expected --device auto, cpu, cuda or cuda:N"),
    ],
)
def test_out_of_range_flags(tmp_path, capsys, argv, message):
    base = ["--model", MODEL, *TINY_ARGS, "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_unreadable_config_files(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [\n")
    assert main(["--config", str(bad)]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    assert main(["--config", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
