"""`pareprop train --memory-budget`: the blocks chosen are stored, recorded in checkpoints, and
a resumed run stores the same ones without measuring again."""

import json
import os

import pytest

import pareprop
import pareprop.trainer.setup as trainer_setup
from pareprop.checkpoint import load_model
from pareprop.cli.train import main
from pareprop.trainer import TrainConfig, Trainer

MODEL = "rev_vit_tiny_patch4_32"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=4, num_heads=2)


def _cfg(tmp_path, **kw):
    base = dict(model=MODEL, model_kwargs=dict(TINY), epochs=2, batch_size=32, max_steps=2,
                out=str(tmp_path), progress=False, memory_budget="0.5")
    base.update(kw)
    return TrainConfig(**base)


def test_budget_is_applied_recorded_and_reused_on_resume(tmp_path, monkeypatch):
    trainer = Trainer(_cfg(tmp_path, stop_after_epochs=1))
    stored = trainer.model.stack.stored_blocks
    assert 0 < len(stored) < 4 and trainer.memory_plan.measured_bytes <= (
        trainer.memory_plan.budget_bytes
    )
    trainer.fit()
    with open(os.path.join(tmp_path, "last", "model.json")) as fh:
        meta = json.load(fh)
    assert meta["model"]["stored_blocks"] == {"stack": list(stored)}
    assert load_model(os.path.join(tmp_path, "last")).stack.stored_blocks == stored

    def no_measuring(*args, **kwargs):
        raise AssertionError("a resumed run must take its stored blocks from the checkpoint")

    # Patched where the trainer looks it up (patching pareprop.memory.budget's would not reach it).
    monkeypatch.setattr(trainer_setup, "set_memory_budget", no_measuring)
    resumed = Trainer(_cfg(tmp_path, resume=os.path.join(tmp_path, "last")))
    assert resumed.model.stack.stored_blocks == stored


def test_bad_budgets_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="memory size"):
        _cfg(tmp_path, memory_budget="twelve gigs")
    with pytest.raises(ValueError, match="between 0"):
        _cfg(tmp_path, memory_budget=1.5)
    with pytest.raises(ValueError, match="every block is stored already"):
        Trainer(_cfg(tmp_path, engine="autograd"))
    with pytest.raises(ValueError, match="below the reversible floor"):
        Trainer(_cfg(tmp_path, memory_budget="1KiB"))


def test_cli_flag(tmp_path, capsys):
    args = [f"--model-arg={k}={v}" for k, v in TINY.items()]
    code = main(["--out", str(tmp_path), "--epochs", "1", "--max-steps", "1", "--batch-size",
                 "16", "--memory-budget", "1", "--no-progress", *args])
    assert code == 0
    assert "stored 4 of 4 blocks" in capsys.readouterr().err
    model = load_model(os.path.join(tmp_path, "last"))
    assert model.stack.stored_blocks == (0, 1, 2, 3)
    assert isinstance(pareprop.memory.budget.stored_blocks(model), dict)


def test_grad_checkpointing_flag_reaches_the_model(tmp_path):
    from pareprop.cli.train import resolve_config

    assert resolve_config(["--grad-checkpointing"]).grad_checkpointing is True
    assert resolve_config([]).grad_checkpointing is False
    cfg = _cfg(tmp_path, model="rev_mvitv2_tiny_32",
               model_kwargs=dict(img_size=16, in_chans=1, embed_dim=8),
               memory_budget=None, grad_checkpointing=True, max_steps=1, epochs=1)
    trainer = Trainer(cfg)
    assert all(s.grad_checkpointing for s in trainer.model.stages)
    summary = trainer.fit()
    assert summary


def test_chunk_bytes_flag_reaches_every_stack_and_trains(tmp_path):
    from pareprop.cli.train import resolve_config

    assert resolve_config(["--chunk-bytes", "256MiB"]).chunk_bytes == "256MiB"
    assert resolve_config([]).chunk_bytes is None
    with pytest.raises(ValueError, match="pareprop plan --chunk-bytes auto"):
        resolve_config(["--chunk-bytes", "auto"])
    with pytest.raises(ValueError, match="256MiB"):
        resolve_config(["--chunk-bytes", "lots"])
    cfg = _cfg(tmp_path, memory_budget=None, chunk_bytes="16KiB", max_steps=2, epochs=1)
    trainer = Trainer(cfg)
    stacks = [m for m in trainer.model.modules() if isinstance(m, pareprop.ReversibleStack)]
    assert stacks and all(s.chunking.max_bytes == 16 * 2**10 for s in stacks)
    assert trainer.fit()
