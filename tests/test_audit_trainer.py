"""The trainer's checks that a run stops or refuses where it must: a non-finite gradient norm
(with a finite loss) stops the run at the norm check itself, the running loss written for
TensorBoard is the metric the epoch logs, ``--log-interval 0`` is refused, and Python's
``random`` is seeded from ``--seed``. Tiny digits runs, a few seconds each."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from pareprop.cli.train import main
from pareprop.trainer import NonFiniteLossError, TrainConfig, Trainer

MODEL = "rev_vit_tiny_patch4_32"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)
TINY_ARGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]


def _cfg(out, **kw):
    base = dict(model=MODEL, model_kwargs=dict(TINY), epochs=2, batch_size=256,
                out=str(out), progress=False, device="cpu")
    return TrainConfig(**{**base, **kw})


def test_an_infinite_gradient_with_a_finite_loss_stops_at_the_norm_check(tmp_path):
    # The gradients turn infinite in backward, before clipping: the loss is finite, so only
    # the gradient norm's check can name the step. Without it, AdamW writes NaN into every
    # weight and a later loss stops the run, naming the wrong cause and step.
    trainer = Trainer(_cfg(tmp_path / "run", epochs=1, log_interval=1))
    weight = trainer.model.head.weight
    calls = []

    def poisoned(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 3 else grad  # step 3's backward

    weight.register_hook(poisoned)
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "the gradient norm is inf at epoch 1, step 3" in message, message
    assert "no checkpoint was written yet" in message
    assert not (tmp_path / "run" / "last").exists()


def _scalars(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_the_tensorboard_running_loss_is_the_mean_loss_of_the_epoch_so_far(tmp_path,
                                                                          monkeypatch):
    pytest.importorskip("tensorboard")
    real, rows = F.cross_entropy, []

    def recorded(logits, target, **kw):
        loss = real(logits, target, **kw)
        if torch.is_grad_enabled():
            rows.append((loss.item(), target.shape[0]))
        return loss

    monkeypatch.setattr(F, "cross_entropy", recorded)
    out = tmp_path / "run"
    # 2 micro-batches per step, a read every 2 steps: each read sums 4 micro-batches.
    trainer = Trainer(_cfg(out, grad_accum=2, log_interval=2, tensorboard=True))
    trainer.fit()
    per_epoch = trainer.micro_per_epoch
    assert len(rows) == 2 * per_epoch
    with open(out / "metrics.jsonl") as f:
        epochs = [r for r in map(json.loads, f) if r["type"] == "epoch"]
    expected = []  # (step, mean loss of the epoch's samples so far) at every read
    for e in range(2):
        total = seen = 0.0
        for i, (loss, n) in enumerate(rows[e * per_epoch:(e + 1) * per_epoch]):
            total, seen = total + loss * n, seen + n
            step = e * trainer.steps_per_epoch + (i + 1) // 2
            if (i + 1) % 2 == 0 and step % 2 == 0:
                expected.append((step, total / seen))
        # the epoch's metric is the same mean over all its samples
        assert epochs[e]["train_loss"] == pytest.approx(total / seen, rel=1e-12)
    written = _scalars(out)["train/loss"]
    assert [s for s, _ in written] == [s for s, _ in expected]
    assert [v for _, v in written] == pytest.approx([v for _, v in expected], rel=1e-6)
    # A read at an epoch's last step writes that epoch's logged metric.
    for record in epochs:
        at_end = dict(written).get(record["step"])
        if at_end is not None:
            assert at_end == pytest.approx(record["train_loss"], rel=1e-6)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_log_interval_below_one_is_refused_in_one_line(tmp_path, capsys, value):
    out = tmp_path / "run"
    rc = main(["--model", MODEL, *TINY_ARGS, "--log-interval", value, "--no-progress",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"expected log_interval >= 1, got {value}" in err
    assert not out.exists()


def test_the_seed_seeds_pythons_random(tmp_path):
    # For a data set of the user's that draws from Python's random (the trainer's own draws
    # come from torch): the same --seed gives the same draws, whatever came before.
    draws = []
    for before in (1, 2):
        random.seed(before)
        Trainer(_cfg(tmp_path / f"run{before}", seed=7))
        draws.append(random.random())
    assert draws[0] == draws[1]
