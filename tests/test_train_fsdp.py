"""``pareprop train --fsdp``: a sharded run (2 gloo processes) resumes exactly, its checkpoint
is the single-process layout and loads on one process, and --fsdp is refused where it cannot
work. The trainer's runs happen in one pair of spawned processes (starting torchrun three times
would cost most of the test's time); ``pareprop.distributed.init`` joins their group as it
joins torchrun's."""

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import pareprop
from pareprop.cli.train import main, resolve_config
from pareprop.distributed.fsdp import fsdp_available
from pareprop.trainer import TIMING_KEYS, TrainConfig, Trainer

pytestmark = [  # slow: spawned process pairs (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(
        not (tdist.is_available() and fsdp_available()), reason="no torch.distributed FSDP2"
    ),
]

TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=3, num_heads=2)


def _cfg(out, **kw):
    # Two micro-batches per step: the first accumulates without reduce-scatter (no_sync).
    base = dict(
        model="rev_vit_tiny_patch4_32", model_kwargs=dict(TINY), epochs=2, batch_size=256,
        grad_accum=2, out=str(out), progress=False, device="cpu", fsdp=True,
    )
    return TrainConfig(**{**base, **kw})


def _fit(cfg):
    # What a fresh torchrun process starts from: the trainer seeds torch, not these.
    random.seed(0)
    np.random.seed(0)
    from pareprop import distributed as dist_lib

    return Trainer(cfg, dist_lib.init("cpu")).fit()


def _worker(rank, world, init_file, tmp):
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _fit(_cfg(os.path.join(tmp, "whole")))
        _fit(_cfg(os.path.join(tmp, "parts"), stop_after_epochs=1))
        _fit(_cfg(os.path.join(tmp, "parts"), resume=os.path.join(tmp, "parts", "last")))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_train")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return tmp


def _epochs(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS}
        for r in records
        if r["type"] == "epoch"
    ]


def test_sharded_run_resumed_after_an_epoch_equals_an_uninterrupted_one(runs):
    whole = load_file(runs / "whole" / "last" / "model.safetensors")
    parts = load_file(runs / "parts" / "last" / "model.safetensors")
    assert sorted(whole) == sorted(parts)
    for name in whole:
        assert torch.equal(whole[name], parts[name]), name
    assert _epochs(runs / "whole") == _epochs(runs / "parts")
    assert [r["step"] for r in _epochs(runs / "parts")] == [6, 12]


def test_sharded_checkpoint_is_whole_and_loads_on_one_process(runs):
    last = runs / "whole" / "last"
    model = pareprop.load_model(last)  # one process, no group: the whole weights
    weights = load_file(last / "model.safetensors")
    own = model.state_dict()
    for name, p in own.items():
        assert tuple(weights[name].shape) == tuple(p.shape), name
    # The optimizer state is whole too, keyed by parameter names.
    state = torch.load(last / "state.pt", weights_only=True)
    assert state["optimizer_layout"] == "full"
    for name, p in model.named_parameters():
        assert state["optimizer"]["state"][name]["exp_avg"].shape == p.shape, name
    # Evaluated on one process, the checkpoint scores what the sharded run recorded for it.
    cfg = TrainConfig(resume=str(last), eval_only=True, device="cpu", progress=False,
                      out=str(runs / "eval"))
    result = Trainer(cfg).fit()
    recorded = _epochs(runs / "whole")[-1]
    assert result["val_acc"] == pytest.approx(recorded["val_acc"], abs=1e-12)
    assert result["val_loss"] == pytest.approx(recorded["val_loss"], rel=1e-5)


def test_fsdp_on_one_process_is_refused_with_the_reason(tmp_path, capsys):
    assert main(["--fsdp", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp shards the model over the processes of a torchrun job" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fsdp_flag_and_its_incompatible_options():
    assert resolve_config(["--fsdp"]).fsdp is True
    assert resolve_config(["--no-fsdp"]).fsdp is False
    assert resolve_config([]).fsdp is False
    with pytest.raises(ValueError, match="--fsdp with --amp fp16 is not supported"):
        TrainConfig(fsdp=True, amp="fp16")


def test_sharded_checkpoint_resumes_on_one_process_without_fsdp(runs):
    # Its optimizer state is whole and keyed by names: set_optimizer_state_dict fits it to an
    # unsharded model too.
    cfg = TrainConfig(resume=str(runs / "whole" / "last"), epochs=3, batch_size=256, grad_accum=2,
                      device="cpu", progress=False, out=str(runs / "one"))
    summary = Trainer(cfg).fit()
    assert summary["epochs_run"] == 1 and summary["step"] == 18
    state = torch.load(runs / "one" / "last" / "state.pt", weights_only=True)
    assert state["optimizer_layout"] == "local"
