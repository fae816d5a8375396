"""Runs of converted models and the coupling their weights were trained at: --resume with
--coupling-steps, a converted run's weights as the start of another run (or of load_pretrained,
or of create_model's pretrained_file), an EMA copy beside a moving schedule, and the message of
a run interrupted between an epoch and its checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from timm.utils import ModelEmaV3

import pareprop
from pareprop.checkpoint import load_checkpoint
from pareprop.cli import main as cli
from pareprop.models.published import PretrainedError
from pareprop.trainer import TrainConfig, Trainer, TrainingInterrupted

SOURCE = "vit_tiny_patch16_224"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)
ARGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]
RUN = ["--batch-size", "512", "--no-progress", "--warmup-epochs", "0"]


def _one_line_error(capsys, rc):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "error" in lines[0], err
    return lines[0]


@pytest.fixture(scope="module")
def reversible_run(tmp_path_factory):
    """A converted run of one epoch at (0, 1) (schedule ``reversible``), coupling steps 3."""
    out = tmp_path_factory.mktemp("run") / "run"
    rc = cli(["train", "--convert-from", SOURCE, "--from-scratch", *ARGS, *RUN,
              "--coupling-schedule", "reversible", "--coupling-steps", "3", "--epochs", "1",
              "--out", str(out)])
    assert rc == 0
    return out


def test_resume_takes_the_runs_coupling_steps_and_refuses_others(reversible_run, capsys):
    capsys.readouterr()
    line = _one_line_error(capsys, cli(["train", "--resume", str(reversible_run),
                                        "--coupling-steps", "4", "--eval-only"]))
    assert "coupling_steps 3 -> 4" in line
    assert cli(["train", "--resume", str(reversible_run), "--coupling-steps", "3",
                "--eval-only"]) == 0, capsys.readouterr().err


def test_weights_of_a_converted_run_start_a_run_only_at_their_coupling(reversible_run, tmp_path,
                                                                       capsys):
    saved = load_checkpoint(str(reversible_run / "last"), train_state=False).state_dict
    weights = str(reversible_run / "last" / "model.safetensors")
    for start in (weights, str(reversible_run)):  # the file alone, and the run directory
        # At (1, 0) they compute another function than the one trained: refused, naming both.
        line = _one_line_error(capsys, cli([
            "train", "--convert-from", SOURCE, "--pretrained-file", start, *ARGS, *RUN,
            "--epochs", "1", "--out", str(tmp_path / "refused")]))
        assert "(0.0, 1.0)" in line and "(1.0, 0.0)" in line and "--resume" in line
        # Where the run starts at their coupling, they load, every tensor.
        cfg = TrainConfig(convert_from=SOURCE, pretrained_file=start, model_kwargs=dict(TINY),
                          coupling_schedule="reversible", epochs=1, batch_size=512,
                          progress=False, out=str(tmp_path / os.path.basename(start)))
        trainer = Trainer(cfg)
        assert pareprop.coupling_of(trainer.model) == (0.0, 1.0)
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(value, saved[key]), key


def test_load_pretrained_and_pretrained_file_refuse_another_coupling(reversible_run):
    x = torch.randn(2, 1, 8, 8)
    trained = pareprop.load_model(str(reversible_run / "last")).eval()
    weights = str(reversible_run / "last" / "model.safetensors")
    model = pareprop.create_model("converted_vit", source=SOURCE, num_classes=10, **TINY)
    for path in (weights, str(reversible_run / "last"), str(reversible_run)):
        with pytest.raises(PretrainedError, match=r"saved at coupling .* \(0.0, 1.0\)"):
            pareprop.load_pretrained(model, path)
    with pytest.raises(PretrainedError, match=r"coupling=\[0.0, 1.0\]"):
        pareprop.create_model("converted_vit", source=SOURCE, num_classes=10,
                              pretrained_file=weights, **TINY)
    # At the file's coupling: the trained network, to the bit.
    pareprop.set_coupling(model, 0.0, 1.0)
    pareprop.load_pretrained(model, weights)
    rebuilt = pareprop.create_model("converted_vit", source=SOURCE, num_classes=10,
                                    pretrained_file=weights, coupling=[0.0, 1.0], **TINY)
    with torch.no_grad():
        want = trained(x)
        assert torch.equal(model.eval()(x), want)
        assert torch.equal(rebuilt.eval()(x), want)


def test_an_ema_copy_keeps_its_coupling_until_set_like_the_models():
    # timm's ModelEmaV3 averages the state dict, which holds no coupling: the copy stays at the
    # coupling it was made at (docs/convert.md), and set_coupling moves it to the model's.
    torch.manual_seed(0)
    model = pareprop.create_model("converted_vit", source=SOURCE, num_classes=3, **TINY)
    ema = ModelEmaV3(model, decay=0.0)  # decay 0: the copy takes the model's weights
    schedule = pareprop.CouplingSchedule(model, "linear", steps=4)
    for _ in range(2):
        schedule.step()
        ema.update(model)
    assert pareprop.coupling_of(model) == (0.5, 0.5)
    assert pareprop.coupling_of(ema.module) == (1.0, 0.0)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert not torch.equal(ema.module.eval()(x), model.eval()(x))
        pareprop.set_coupling(ema.module, *pareprop.coupling_of(model))
        assert torch.equal(ema.module(x), model(x))


def test_an_interruption_before_the_checkpoint_names_the_epoch_not_saved(tmp_path,
                                                                        monkeypatch):
    import pareprop.checkpoint as ckpt_lib

    real, calls = ckpt_lib.save_checkpoint, []

    def save(*args, **kwargs):
        calls.append(kwargs["epoch"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while epoch 2's checkpoint is written
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_lib, "save_checkpoint", save)
    trainer = Trainer(TrainConfig(epochs=3, batch_size=512, warmup_epochs=0, progress=False,
                                  out=str(tmp_path / "run")))
    with pytest.raises(TrainingInterrupted) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "after epoch 2" in message and "before its checkpoint was written" in message
    assert "epoch 3" not in message and "epoch0001" in message
