"""Checkpoints: rebuild by name, last/best links, atomic writes, clear errors."""

import json
import os
import random

import pytest
import torch

import pareprop
from pareprop import checkpoint as ck

TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=2)


def _model(**kw):
    torch.manual_seed(0)
    return pareprop.create_model("rev_vit_tiny_patch4_32", **{**TINY, **kw})


def _state(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    return {"optimizer": opt.state_dict(), "epoch": 1, "rng": [ck.rng_state()]}


def test_round_trip_rebuilds_the_model(tmp_path):
    model = _model(drop_path_rate=0.1)
    path = ck.save_checkpoint(
        tmp_path, model, epoch=1, step=10, metrics={"val_acc": 0.5}, train_state=_state(model)
    )
    assert os.path.realpath(tmp_path / "last") == path
    meta = json.loads((tmp_path / "last" / "model.json").read_text())
    assert meta["model"] == {
        "name": "rev_vit_tiny_patch4_32",
        "kwargs": {**TINY, "drop_path_rate": 0.1},
    }
    again = ck.load_model(tmp_path / "last")
    x = torch.randn(3, 1, 8, 8)
    model.eval(), again.eval()
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
    loaded = ck.load_checkpoint(tmp_path)  # a run directory means its last checkpoint
    assert loaded.epoch == 1 and loaded.step == 10 and loaded.meta["metrics"]["val_acc"] == 0.5
    opt = torch.optim.AdamW(again.parameters(), lr=1e-3)
    opt.load_state_dict(loaded.train_state["optimizer"])


def test_rng_state_round_trip():
    import numpy as np

    state = ck.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    ck.set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_last_and_best_links_and_pruning(tmp_path):
    model = _model()
    first = ck.save_checkpoint(tmp_path, model, epoch=1, step=1, tags=("last", "best"))
    second = ck.save_checkpoint(tmp_path, model, epoch=2, step=2, tags=("last",))
    assert os.path.realpath(tmp_path / "best") == first
    assert os.path.realpath(tmp_path / "last") == second
    third = ck.save_checkpoint(tmp_path, model, epoch=3, step=3, tags=("last", "best"))
    # epoch 1 and 2 are pointed at by nothing any more and are deleted
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [os.path.basename(third)]


def _interrupted_save(tmp_path, monkeypatch, target, fail_on_call):
    model = _model()
    ck.save_checkpoint(tmp_path, model, epoch=1, step=5, train_state=_state(model))
    real, calls = getattr(target[0], target[1]), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_on_call:
            if target[1] == "save":  # leave a half-written file behind, like a killed process
                with open(args[1], "wb") as f:
                    f.write(b"\x80\x02partial")
            raise KeyboardInterrupt("killed while saving")
        return real(*args, **kwargs)

    monkeypatch.setattr(target[0], target[1], failing)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, model, epoch=2, step=10, train_state=_state(model))
    monkeypatch.undo()
    loaded = ck.load_checkpoint(tmp_path / "last")
    assert loaded.epoch == 1 and loaded.step == 5
    ck.load_model(tmp_path / "last")  # weights intact and consistent
    leftovers = [n for n in os.listdir(tmp_path / "checkpoints") if n.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("fail_on_call", [1, 2, 3, 4, 5])
def test_interrupted_rename_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_on_call):
    # os.replace runs for: weights, state, model.json, the directory, the 'last' link.
    _interrupted_save(tmp_path, monkeypatch, (os, "replace"), fail_on_call)


def test_interrupted_writer_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _interrupted_save(tmp_path, monkeypatch, (torch, "save"), 1)


def test_corrupted_weights_are_detected(tmp_path):
    ck.save_checkpoint(tmp_path, _model(), epoch=1, step=1)
    weights = tmp_path / "last" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="corrupted: model.safetensors"):
        ck.load_checkpoint(tmp_path / "last")


def test_truncated_state_is_detected(tmp_path):
    model = _model()
    ck.save_checkpoint(tmp_path, model, epoch=1, step=1, train_state=_state(model))
    state = tmp_path / "last" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match="corrupted: state.pt"):
        ck.load_checkpoint(tmp_path / "last")


def test_foreign_files_are_refused(tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save(_model().state_dict(), plain)
    with pytest.raises(ck.CheckpointError, match="not a pareprop checkpoint"):
        ck.load_checkpoint(plain)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ck.CheckpointError, match="not a pareprop checkpoint"):
        ck.load_checkpoint(other)
    (other / "model.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="not JSON"):
        ck.load_checkpoint(other)
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load_checkpoint(tmp_path / "missing")


def test_state_with_code_is_refused(tmp_path):
    # A state.pt that would run code when unpickled: weights_only loading refuses it.
    model = _model()
    ck.save_checkpoint(tmp_path, model, epoch=1, step=1, train_state={"x": 1})
    folder = tmp_path / "last"
    torch.save({"format": ck.FORMAT, "evil": ck.Checkpoint}, folder / "state.pt")
    meta = json.loads((folder / "model.json").read_text())
    meta["sha256"]["state.pt"] = ck._sha256(folder / "state.pt")
    (folder / "model.json").write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="cannot read the training state"):
        ck.load_checkpoint(folder)


def test_weights_that_do_not_fit(tmp_path):
    ck.save_checkpoint(tmp_path, _model(), epoch=1, step=1)
    other = _model(embed_dim=16)
    with pytest.raises(ck.CheckpointError, match="does not fit"):
        ck.load_weights(other, ck.load_checkpoint(tmp_path / "last"))
