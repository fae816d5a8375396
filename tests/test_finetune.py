"""Fine-tuning a converted timm ViT: create_model("converted_vit") with timm weights from a
file, `pareprop train --convert-from`, the coupling schedule stepped by the trainer, its state
in checkpoints, and exact resume."""

import json
import os

import pytest
import timm
import torch
from safetensors.torch import save_file

import pareprop
from pareprop.checkpoint import load_checkpoint, load_model
from pareprop.cli.train import main, resolve_config
from pareprop.trainer import TIMING_KEYS, TrainConfig, Trainer

SOURCE = "vit_tiny_patch16_224"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)


def _pretrained(tmp_path, num_classes=5):
    torch.manual_seed(0)
    source = timm.create_model(SOURCE, num_classes=num_classes, **TINY)
    path = str(tmp_path / "timm.safetensors")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
    return source.eval(), path


def test_converted_model_from_a_timm_weights_file(tmp_path):
    source, path = _pretrained(tmp_path)
    model = pareprop.create_model("converted_vit", source=SOURCE, pretrained_file=path,
                                  num_classes=5, **TINY).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    # another class count: the pretrained body, a fresh head (timm's loader)
    other = pareprop.create_model("converted_vit", source=SOURCE, pretrained_file=path,
                                  num_classes=3, **TINY).eval()
    assert other(x).shape == (2, 3)
    with torch.no_grad():
        assert torch.equal(other.forward_features(x), source.forward_features(x))


def _cfg(tmp_path, path, **kw):
    base = dict(convert_from=SOURCE, pretrained_file=path, model_kwargs=dict(TINY),
                coupling_schedule="cosine", coupling_steps=3, epochs=2, batch_size=128,
                lr=1e-3, warmup_epochs=0, out=str(tmp_path), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def _epochs(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in records if r["type"] == "epoch"]


def test_trainer_steps_the_schedule_and_checkpoints_the_coupling(tmp_path):
    _, path = _pretrained(tmp_path)
    trainer = Trainer(_cfg(tmp_path / "run", path, epochs=1, max_steps=2))
    assert pareprop.coupling_of(trainer.model) == (1.0, 0.0)
    trainer.fit()
    alpha, beta = pareprop.coupling_of(trainer.model)
    assert 0.0 < beta < 1.0 and alpha == pytest.approx(1 - beta)  # 2 of 3 cosine steps
    loaded = load_model(tmp_path / "run" / "last")
    assert pareprop.coupling_of(loaded) == pytest.approx((alpha, beta))
    assert load_checkpoint(tmp_path / "run" / "last").train_state["coupling"]["step_count"] == 2
    # --eval-only evaluates at the coupling the model was trained at, not the schedule's start
    evaluator = Trainer(_cfg(tmp_path / "eval", path, resume=str(tmp_path / "run" / "last"),
                             eval_only=True))
    assert pareprop.coupling_of(evaluator.model) == pytest.approx((alpha, beta))


def test_coupling_steps_set_the_schedules_length():
    from types import SimpleNamespace

    from pareprop.trainer.finetune import make_coupling_schedule

    model = pareprop.create_model("converted_vit", source=SOURCE, num_classes=5, **TINY)
    for steps, want in ((3, 3), (None, 10)):  # unset: one epoch
        cfg = SimpleNamespace(coupling_steps=steps, coupling_schedule="linear", resume=None)
        assert make_coupling_schedule(cfg, model, steps_per_epoch=10).steps == want


def test_resume_through_the_schedule_is_exact(tmp_path):
    _, path = _pretrained(tmp_path)
    Trainer(_cfg(tmp_path / "full", path)).fit()
    part = tmp_path / "part"
    Trainer(_cfg(part, path, stop_after_epochs=1)).fit()
    Trainer(_cfg(part, path, resume=str(part / "last"))).fit()
    assert _epochs(part) == _epochs(tmp_path / "full")
    a, b = load_model(tmp_path / "full" / "last"), load_model(part / "last")
    assert pareprop.coupling_of(a) == pareprop.coupling_of(b) == (0.0, 1.0)


def test_cli_flags(tmp_path, capsys):
    cfg = resolve_config(["--convert-from", SOURCE, "--coupling-schedule", "linear",
                          "--coupling-steps", "7", "--model-arg", "depth=2"])
    assert cfg.model == "converted_vit" and cfg.model_kwargs == {"depth": 2, "source": SOURCE}
    assert (cfg.coupling_schedule, cfg.coupling_steps) == ("linear", 7)
    assert main(["--convert-from", "no_such_vit", "--out", str(tmp_path)]) == 2
    assert "names no model pareprop converts" in capsys.readouterr().err
    # Without --convert-from the file starts the registered model (published weights, issue 23).
    assert main(["--pretrained-file", "x.safetensors", "--out", str(tmp_path)]) == 2
    assert "no weight file at 'x.safetensors'" in capsys.readouterr().err


def test_memory_budget_with_convert_is_refused(tmp_path):
    with pytest.raises(ValueError, match="precision guard chooses"):
        TrainConfig(convert_from=SOURCE, memory_budget=0.5, out=str(tmp_path))


def test_a_converted_model_can_be_planned():
    # plan_memory builds by name on fake tensors: the guard cannot measure there (None).
    plans = {}
    for coupling in ((1.0, 0.0), (0.0, 1.0)):
        plans[coupling] = pareprop.plan_memory(
            "converted_vit", 2, "reversible", device="cpu", source=SOURCE, depth=2,
            img_size=32, num_classes=10, tolerance=None, coupling=coupling)
    # every block stored at (1, 0), none at (0, 1); at this size the optimizer step sets the
    # peak, so the activations tell (depth and img_size reach the source: 32 pixels, 2 blocks)
    assert plans[(0.0, 1.0)].activations < plans[(1.0, 0.0)].activations
    assert plans[(0.0, 1.0)].parameters < 5_000_000


def _fake_timm_hub(monkeypatch, weights=None):
    """timm.create_model as seen by the trainer, with pretrained=True answered from ``weights``
    (a seed: timm's model of that seed stands for its download), or failing as offline."""
    real = timm.create_model
    calls = []

    def create(name, pretrained=False, **kw):
        if not pretrained:
            return real(name, **kw)
        calls.append(kw)
        if weights is None:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load this file")
        torch.manual_seed(weights)
        return real(name, **kw)

    monkeypatch.setattr(timm, "create_model", create)
    return calls


def _tiny_args():
    return [f"--model-arg={k}={v}" for k, v in TINY.items()]


def test_convert_from_offline_refuses_naming_pretrained_file(tmp_path, monkeypatch, capsys):
    # Issue 34.1: it used to train a random ViT and report as normal.
    _fake_timm_hub(monkeypatch)
    rc = main(["--convert-from", SOURCE, *_tiny_args(), "--epochs", "1", "--max-steps", "1",
               "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "--pretrained-file" in err and "--from-scratch" in err
    assert not (tmp_path / "run" / "last").exists()


def test_convert_from_starts_at_timms_pretrained_weights(tmp_path, monkeypatch):
    calls = _fake_timm_hub(monkeypatch, weights=123)
    trainer = Trainer(TrainConfig(convert_from=SOURCE, model_kwargs=dict(TINY), epochs=1,
                                  out=str(tmp_path / "run"), progress=False))
    assert calls and calls[0]["num_classes"] == 10  # the data's classes: a fresh head
    torch.manual_seed(123)
    timm_vit = timm.create_model(SOURCE, num_classes=10, **TINY)
    ours = trainer.model.state_dict()
    for key, value in timm_vit.state_dict().items():
        if not key.startswith("head."):
            assert torch.equal(ours[key], value), key


def test_random_weights_only_when_asked_by_name(tmp_path, monkeypatch):
    calls = _fake_timm_hub(monkeypatch)  # any download would fail
    for flags in (dict(from_scratch=True), dict(model_kwargs={**TINY, "pretrained": False})):
        kw = dict(convert_from=SOURCE, model_kwargs=dict(TINY), epochs=1, progress=False,
                  out=str(tmp_path / str(len(calls))))
        cfg = TrainConfig(**{**kw, **flags})
        assert cfg.from_scratch and "pretrained" not in cfg.model_kwargs
        Trainer(cfg)
    assert calls == []
    with pytest.raises(ValueError, match="--from-scratch and --pretrained-file x.pt"):
        TrainConfig(convert_from=SOURCE, from_scratch=True, pretrained_file="x.pt")


def test_a_pretrained_start_validates_with_the_models_data_config(tmp_path):
    # Issue 34.2: an augreg ViT (mean = std = 0.5) was fine-tuned on ImageNet's statistics.
    from PIL import Image

    for c in range(2):
        (tmp_path / "data" / f"c{c}").mkdir(parents=True)
        for i in range(3):
            image = Image.new("RGB", (12, 12), (80 * c, 40 * i, 9))
            image.save(tmp_path / "data" / f"c{c}" / f"{i}.png")
    _, path = _pretrained(tmp_path, num_classes=2)
    trainer = Trainer(_cfg(tmp_path / "run", path, dataset=str(tmp_path / "data")))
    config = trainer.data.data_config
    assert timm.models.get_pretrained_cfg(SOURCE).mean == (0.5, 0.5, 0.5)
    assert config["mean"] == config["std"] == [0.5] and config["interpolation"] == "bicubic"
    assert config["input_size"] == [1, 8, 8]


def _timm_hub_of_default_weights(monkeypatch):
    """timm's own load_pretrained, fed the weights of the source's default configuration
    (what the hub holds), so timm raises what it raises on a download."""
    import timm.models._builder as builder

    weights = timm.create_model(SOURCE).state_dict()
    monkeypatch.setattr(builder, "load_state_dict_from_hf", lambda *a, **k: dict(weights))


def test_model_args_that_do_not_fit_timms_weights_are_named_in_one_line(monkeypatch):
    from pareprop.convert.timm_pretrained import load_timm_pretrained
    from pareprop.pretrained import PretrainedError

    _timm_hub_of_default_weights(monkeypatch)
    # img_size and num_heads fit (timm resamples pos_embed; heads change no shape); depth at
    # timm's 1000 classes (a strict load) and embed_dim do not.
    model = pareprop.create_model("converted_vit", source=SOURCE, tolerance=None, depth=2,
                                  embed_dim=16, num_heads=2, img_size=32)
    with pytest.raises(PretrainedError) as err:
        load_timm_pretrained(model, SOURCE)
    text = str(err.value)
    assert "\n" not in text and "--model-arg depth=2 --model-arg embed_dim=16 (" in text
    assert "drop depth, embed_dim from --model-arg" in text and "num_heads" not in text
    assert "--pretrained-file" in text and "--from-scratch" in text
    assert "(cls_token: (1, 1, 192) in the weights, (1, 1, 16) here" in text
    fits = pareprop.create_model("converted_vit", source=SOURCE, tolerance=None, depth=2,
                                 num_classes=10, img_size=32)
    load_timm_pretrained(fits, SOURCE)  # another class count: timm loads the first blocks


def test_config_fields_timm_does_not_take_are_named_in_one_line(monkeypatch):
    # converted_mvitv2 applies MultiScaleVitCfg fields itself; timm's factory refuses them.
    from pareprop.convert.timm_pretrained import load_timm_pretrained
    from pareprop.pretrained import PretrainedError

    model = pareprop.create_model("converted_mvitv2", source="mvitv2_tiny", tolerance=None,
                                  depths=[1, 1, 1, 1], img_size=32, num_classes=3)
    with pytest.raises(PretrainedError, match=r"--model-arg depths=\[1, 1, 1, 1\] \(.*"
                       r"unexpected keyword argument 'depths'\); drop depths from --model-arg"):
        load_timm_pretrained(model, "mvitv2_tiny")


def test_cli_convert_from_with_a_misfit_model_arg_is_one_line(tmp_path, monkeypatch, capsys):
    _timm_hub_of_default_weights(monkeypatch)
    rc = main(["--convert-from", SOURCE, "--model-arg", "embed_dim=24",
               "--model-arg", "img_size=32", "--model-arg", "depth=1", "--epochs", "1",
               "--max-steps", "1", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "--model-arg embed_dim=24 (" in err and "img_size" not in err.split("(")[0]
