"""Device names and seeds at their edges: ``auto`` refused where a command cannot pick a device
for itself, ``cuda:N`` checked against the device count (faked here), and the largest seed,
2**32 - 1, accepted and trained with."""

import pytest
import torch

from pareprop.cli import main as cli
from pareprop.cli.train import resolve_config
from pareprop.devices import check_device_name, device_here
from pareprop.trainer import TrainConfig, Trainer
from pareprop.trainer.config import MAX_SEED


def _one_line_error(capsys, argv, *parts):
    rc = cli(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in lines[0], lines[0]


def test_auto_is_refused_where_a_command_cannot_take_it(capsys):
    check_device_name("auto", auto=True)  # train picks a device itself
    with pytest.raises(ValueError, match=r"expected --device cpu, cuda or cuda:N, got 'auto'"):
        check_device_name("auto")
    with pytest.raises(ValueError, match=r"expected --device cpu, cuda or cuda:N, got 'auto'"):
        device_here("auto")
    _one_line_error(capsys, ["bench", "--device", "auto"], "--device", "'auto'",
                    "cpu, cuda or cuda:N")
    _one_line_error(capsys, ["eval", "--model", "rev_vit_tiny_patch4_32", "--device", "auto"],
                    "--device", "'auto'", "cpu, cuda or cuda:N")


def test_a_cuda_index_past_the_device_count_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_here("cuda:1") == torch.device("cuda", 1)
    assert device_here("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device"):
        device_here("cuda:2")
    _one_line_error(capsys, ["bench", "--device", "cuda:2"], "cuda:2",
                    "this machine has 2 CUDA device(s)")


def test_the_largest_seed_is_accepted_and_trains(tmp_path):
    assert MAX_SEED == 2**32 - 1
    cfg = resolve_config(["--seed", str(MAX_SEED), "--out", str(tmp_path / "run")])
    assert cfg.seed == MAX_SEED
    with pytest.raises(ValueError, match=r"expected --seed from 0 to 4294967295"):
        TrainConfig(seed=MAX_SEED + 1)
    # numpy takes seeds below 2**32, torch's per-epoch seeds go past it: one step runs.
    tiny = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=2, num_heads=2)
    trainer = Trainer(TrainConfig(model_kwargs=tiny, seed=MAX_SEED, epochs=1, batch_size=256,
                                  max_steps=1, out=str(tmp_path / "run"), progress=False,
                                  device="cpu"))
    trainer.fit()
    assert trainer.step == 1
