"""A non-finite loss on one process stops every process, under DDP and under FSDP2: the one
that found it names it, the others say another process found it, and all stop at the same
read (none is left waiting in a collective for a peer that has gone). Two gloo processes."""

import os

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from _two_processes import on_two_processes
from pareprop.distributed.fsdp import fsdp_available

pytestmark = [  # slow: a spawned process pair (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(not tdist.is_available(), reason="no torch.distributed"),
]

TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)


def _run(out, fsdp, rank):
    from pareprop import distributed as dist_lib
    from pareprop.trainer import TrainConfig, Trainer

    real, calls = F.cross_entropy, []

    def poisoned(logits, target, **kw):
        loss = real(logits, target, **kw)
        if torch.is_grad_enabled() and rank == 1:
            calls.append(1)
            if len(calls) == 2:
                # NaN in the value only: the gradients (the sum of every process's) stay
                # finite, so no other process can find anything wrong by itself.
                return loss + torch.tensor(float("nan"))
        return loss

    F.cross_entropy = poisoned
    try:
        cfg = TrainConfig(model="rev_vit_tiny_patch4_32", model_kwargs=dict(TINY), epochs=1,
                          batch_size=256, log_interval=1, out=out, progress=False,
                          device="cpu", fsdp=fsdp)
        Trainer(cfg, dist_lib.init("cpu")).fit()
        return "finished"
    except Exception as e:  # what each process stopped with, checked by the test
        return f"{type(e).__name__}: {e}"
    finally:
        F.cross_entropy = real


def _on_rank(rank, world, tmp, modes):
    return {mode: _run(os.path.join(tmp, mode), mode == "fsdp", rank) for mode in modes}


def test_a_nan_on_one_process_stops_every_process(tmp_path):
    modes = ["ddp", "fsdp"] if fsdp_available() else ["ddp"]
    # A process left waiting for a peer that stopped fails in seconds, not in 30 minutes.
    results = on_two_processes(_on_rank, tmp_path, str(tmp_path), modes, timeout_s=60)
    for mode in modes:
        found, told = results[1][mode], results[0][mode]
        assert found.startswith("NonFiniteLossError: loss is nan at epoch 1, step 2"), found
        assert told.startswith(
            "NonFiniteLossError: another process found a non-finite loss or gradient norm in "
            "epoch 1, by step 2"), told
        assert not os.path.exists(tmp_path / mode / "last")  # nothing saved
