"""detectron2's ViTDet backbone (ViT + simple feature pyramid), reversible: exact at (1, 0)
against a plain reference that mirrors detectron2's published forward
(tests/_detectron2_reference.py, detectron2 at 02b5c4e2), and every engine's gradients equal
autograd's at other couplings. Tiny configurations: width 32, depth 3, windows of 4 with
padding, absolute positions resized from a 4 x 4 grid, relative tables resized too."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import _detectron2_reference as ref
import pareprop
from pareprop.detection.detectron2 import UnsafePickleError, from_detectron2
from pareprop.engine.testing import engine_errors, worst_error

TINY = dict(embed_dim=32, depth=3, num_heads=2, window_size=4, window_block_indexes=(0, 2),
            img_size=128, pretrain_img_size=64, drop_path_rate=0.0)


def _reference(dtype=torch.float64, drop_path_rate=0.0, seed=0):
    args = {**TINY, "drop_path_rate": drop_path_rate}
    net = ref.ViT(patch_size=16, mlp_ratio=4.0, use_rel_pos=True, **args)
    return ref.randomize(ref.SimpleFeaturePyramid(net), seed).to(dtype)


def _images(n=2, dtype=torch.float64, size=(96, 112)):
    torch.manual_seed(1)
    return torch.randn(n, 3, *size, dtype=dtype)


def _ours(state, dtype=torch.float64, **kw):
    args = {**TINY, **kw}
    return from_detectron2(state, "vitdet_b", dtype=dtype, **args)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equals_detectron2_at_1_0_from_a_zoo_file(tmp_path, dtype, tol):
    model, want, got = ref.zoo_file_outputs(tmp_path, _reference(dtype),
                                            lambda path: _ours(path, dtype=dtype),
                                            _images(dtype=dtype))
    assert model.out_channels == 256
    ref.check_pyramid(got, want, [(24, 28), (12, 14), (6, 7), (3, 3), (2, 2)], tol)


@pytest.mark.parametrize("engine", ["autograd", "reversible", "pareprop"])
def test_training_step_at_1_0_equals_detectron2_under_every_engine(engine):
    # Drop-path on: the same seed draws the same masks in the same order (two a block).
    reference = _reference(drop_path_rate=0.3).train()
    model = _ours(reference.state_dict(), engine=engine, drop_path_rate=0.3).train()
    x = _images()
    grads = ref.training_step_grads(reference, model, x)
    for name, (ours, theirs) in grads.items():
        assert ref.relative(ours, theirs) < 1e-10, name


@pytest.mark.parametrize("coupling", [(0.0, 1.0), (0.3, 0.5)])
def test_every_engine_equals_autograd_at_other_couplings(coupling):
    model = _ours(None, drop_path_rate=0.2, coupling=coupling, tolerance=None)
    ref.randomize(model)
    report = engine_errors(model, _images())
    engine, key, err = worst_error(report)
    assert err < 1e-10, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_chunked_branches_and_the_guard_keep_gradients_exact():
    model = _ours(None, drop_path_rate=0.2)
    ref.randomize(model)
    schedule = pareprop.CouplingSchedule(model, "linear", steps=2)
    schedule.step()  # (0.5, 0.5): the guard measures on the next training step
    pareprop.set_chunking(model, chunks=2)
    report = engine_errors(model, _images(n=3))
    assert model.precision_guard.report is not None
    assert model.precision_guard.report.beta == 0.5
    assert worst_error(report)[2] < 1e-10


def test_imagenet_mae_file_loads_the_vit_and_leaves_the_pyramid(tmp_path):
    # MAE's encoder file: {"model": {classifier names}} saved by torch; detectron2 matches it
    # to backbone.net.* by suffix and keeps the 224-pixel position table, resized in forward.
    reference = _reference()
    net = {k[len("net."):]: v for k, v in reference.state_dict().items() if k.startswith("net.")}
    net = {k: v for k, v in net.items() if "rel_pos" not in k}  # MAE has no relative tables
    net["cls_token"] = torch.zeros(1, 1, 32, dtype=torch.float64)
    net["norm.weight"] = torch.ones(32, dtype=torch.float64)
    path = tmp_path / "mae_pretrain_vit_base.pth"
    torch.save({"model": net}, path)
    model = _ours(os.fspath(path))
    report = model.load_report
    assert report.layout == "imagenet"
    assert report.unused == ["cls_token", "norm.weight"]
    assert all(k.startswith("simfp_") or "rel_pos" in k for k in report.left_at_init)
    own = model.state_dict()
    for k, v in net.items():
        if k not in report.unused:
            assert torch.equal(own["net." + k], v), k


def test_a_file_of_another_configuration_is_refused_in_one_line(tmp_path):
    path = ref.write_zoo_pickle(tmp_path / "m.pkl", _reference().state_dict())
    with pytest.raises(pareprop.PretrainedError) as info:
        _ours(os.fspath(path), embed_dim=64, num_heads=2)
    assert "misshapen" in str(info.value) and "\n" not in str(info.value)


class _Marker:
    """A pickled object whose reconstruction would create a file (a harmless stand-in for
    running any command)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    payload = {"model": {"backbone.net.pos_embed": _Marker(marker)}, "__author__": "x"}
    path = tmp_path / "model_final.pkl"
    path.write_bytes(pickle.dumps(payload))
    with pytest.raises(UnsafePickleError) as info:
        from_detectron2(os.fspath(path), "vitdet_b", **TINY)
    message = str(info.value)
    assert "system" in message and "\n" not in message
    assert not marker.exists()
    # Negative control: the same bytes through the plain unpickler do run it.
    pickle.loads(path.read_bytes())
    assert marker.exists()


def test_arrays_of_objects_and_foreign_globals_are_refused(tmp_path):
    import numpy as np

    path = tmp_path / "objects.pkl"
    path.write_bytes(pickle.dumps({"model": {"a": np.array([1, "x"], dtype=object)}}))
    with pytest.raises(UnsafePickleError, match="objects"):
        from_detectron2(os.fspath(path), "vitdet_b", **TINY)
    path.write_bytes(pickle.dumps({"model": {"a": torch.zeros(2)}}))
    with pytest.raises(UnsafePickleError, match="torch"):
        from_detectron2(os.fspath(path), "vitdet_b", **TINY)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_zoo_pickles_of_every_protocol_read_back_exactly(tmp_path, protocol):
    import numpy as np

    from pareprop.detection.detectron2 import read_zoo_file

    arrays = {"backbone.a": np.arange(6, dtype=np.float32).reshape(2, 3),
              "backbone.b": np.array(3.5, dtype=np.float64), "c": np.int64(7)}
    path = tmp_path / "m.pkl"
    path.write_bytes(pickle.dumps({"model": arrays, "__author__": "x"}, protocol=protocol))
    weights, info = read_zoo_file(os.fspath(path))
    assert info == {"__author__": "x"}
    assert set(weights) == set(arrays)
    for k, v in arrays.items():
        assert torch.equal(weights[k], torch.as_tensor(np.asarray(v))), k


def test_a_pkl_that_is_a_torch_file_is_read_by_torch_with_weights_only(tmp_path):
    from pareprop.detection.detectron2 import read_zoo_file

    path = tmp_path / "converted.pkl"
    torch.save({"model": {"backbone.a": torch.arange(3.0)}}, path)
    weights, info = read_zoo_file(os.fspath(path))
    assert torch.equal(weights["backbone.a"], torch.arange(3.0)) and info == {}
