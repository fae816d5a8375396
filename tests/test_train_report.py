"""What a training run reads from the device and reports: one host read per log interval
(issue 39.7) with the metrics of a read per micro-batch, and ``--tensorboard`` (issue 39.8)."""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pareprop.cli.train import main
from pareprop.trainer import TrainConfig, Trainer

MODEL = "rev_vit_tiny_patch4_32"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)


def _cfg(out, **kw):
    base = dict(model=MODEL, model_kwargs=dict(TINY, drop_path_rate=0.1), epochs=2,
                batch_size=64, grad_accum=2, log_interval=3, out=str(out), progress=False)
    return TrainConfig(**{**base, **kw})


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's values by the host: .item(), float(), bool() (the
    dispatcher's _local_scalar_dense) and .tolist() (which bypasses the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def pause_in(self, optimizer):
        # AdamW reads its step counters, which are CPU tensors on every device: no wait for
        # the device, and none of the loop's doing.
        step = optimizer.step

        def paused(*args, **kwargs):
            self.paused = True
            try:
                return step(*args, **kwargs)
            finally:
                self.paused = False

        optimizer.step = paused


def test_an_epoch_reads_the_device_once_per_log_interval(tmp_path, monkeypatch):
    trainer = Trainer(_cfg(tmp_path / "run"))
    # Batches made first: augmentation reads its random draws (.item()) on the host, and that
    # is the data pipeline, not the loop waiting for the device.
    trainer.train_loader, trainer.val_loader = list(trainer.train_loader), list(trainer.val_loader)
    reads = _HostReads()
    reads.pause_in(trainer.optimizer)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads.count += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with reads:
        trainer.train_epoch()
    steps = trainer.step
    assert steps >= 6 and trainer.micro_per_epoch >= 2 * steps - 1  # several intervals
    # one read every 3 steps and one at the end of the epoch; main read 3 per micro-batch
    assert 1 <= reads.count <= steps // 3 + 1, (reads.count, steps)
    with reads:
        trainer.evaluate()
    assert reads.count <= steps // 3 + 2  # and one for the whole validation set


def test_the_metrics_are_those_of_a_read_per_micro_batch(tmp_path, monkeypatch):
    # The old loop added loss.item() * n, correct and n to float64 sums each micro-batch;
    # reading once per interval must give the same numbers, bit for bit.
    real, train_rows, val_rows = F.cross_entropy, [], []

    def recorded(logits, target, **kw):
        loss = real(logits, target, **kw)
        correct = (logits.argmax(-1) == target).sum().item()
        rows = train_rows if torch.is_grad_enabled() else val_rows
        rows.append((loss.item(), correct, target.shape[0]))
        return loss

    trainer = Trainer(_cfg(tmp_path / "run"))
    monkeypatch.setattr(F, "cross_entropy", recorded)
    record = trainer.train_epoch()
    val = trainer.evaluate()

    def old_sums(rows, times_n):
        sums = torch.zeros(3, dtype=torch.float64)
        for loss, correct, n in rows:
            sums += torch.tensor([loss * n if times_n else loss, correct, n], dtype=torch.float64)
        return [sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()]

    assert [record["train_loss"], record["train_acc"]] == old_sums(train_rows, True)
    assert [val["val_loss"], val["val_acc"]] == old_sums(val_rows, False)
    # each step's loss is its last micro-batch's (2 per step; the epoch's last may be alone)
    last_of_step = [row[0] for i, row in enumerate(train_rows) if i % 2 == 1]
    if len(train_rows) % 2:
        last_of_step.append(train_rows[-1][0])
    assert trainer.step_losses == last_of_step


def _scalars(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_writes_the_run_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    argv = ["--model", MODEL, *[f"--model-arg={k}={v}" for k, v in TINY.items()],
            "--batch-size", "64", "--epochs", "2", "--log-interval", "5", "--tensorboard",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    with open(out / "metrics.jsonl") as f:
        epochs = [r for r in map(json.loads, f) if r["type"] == "epoch"]
    scalars = _scalars(out)
    for name in ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "samples_per_s",
                 "peak_mem_mb"):
        written = scalars[f"epoch/{name}"]
        assert [s for s, _ in written] == [r["step"] for r in epochs], name
        assert [v for _, v in written] == pytest.approx([r[name] for r in epochs], rel=1e-6)
    steps = epochs[-1]["step"]
    for name in ("loss", "lr", "samples_per_s", "peak_mem_mb"):
        written = scalars[f"train/{name}"]
        assert [s for s, _ in written] == list(range(5, steps + 1, 5)), name
        assert all(math.isfinite(v) and v > 0 for _, v in written), name


def test_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    rc = main(["--tensorboard", "--out", str(tmp_path / "run"), "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "--tensorboard needs the tensorboard package" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_a_non_finite_loss_is_named_at_its_step_though_read_later(tmp_path, monkeypatch, capsys):
    # Read at the end of the epoch (log interval 50): the message still names step 8, where
    # the loss went NaN, and the epoch-1 checkpoint stays the last one.
    real, calls = F.cross_entropy, []

    def poisoned(logits, target, **kw):
        loss = real(logits, target, **kw)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) >= 8:  # 6 steps an epoch: step 2 of epoch 2 and on
                return loss * float("nan")
        return loss

    monkeypatch.setattr(F, "cross_entropy", poisoned)
    argv = ["--model", MODEL, *[f"--model-arg={k}={v}" for k, v in TINY.items()],
            "--batch-size", "256", "--epochs", "3", "--log-interval", "50", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "loss is nan at epoch 2, step 8: stopped before the weights were saved" in err
    assert "last good checkpoint" in err and "epoch0001-step00000006" in err


def test_a_resumed_run_drops_the_scalars_of_the_lost_part(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "run"
    argv = ["--model", MODEL, *[f"--model-arg={k}={v}" for k, v in TINY.items()],
            "--batch-size", "256", "--epochs", "2", "--log-interval", "2", "--tensorboard",
            "--no-progress", "--out", str(out)]
    assert main([*argv, "--stop-after-epochs", "1"]) == 0
    saved = _scalars(out)["epoch/val_acc"]
    # a run killed in epoch 2 left scalars past its checkpoint (step 6)
    with SummaryWriter(str(out / "tensorboard")) as lost:
        for step in (8, 10):
            lost.add_scalar("train/loss", 99.0, step)
    assert main(["--resume", str(out), "--no-progress"]) == 0
    scalars = _scalars(out)
    assert 99.0 not in [v for _, v in scalars["train/loss"]]
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert scalars["epoch/val_acc"][0] == saved[0] and len(scalars["epoch/val_acc"]) == 2
