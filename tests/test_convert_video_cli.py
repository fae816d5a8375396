"""``pareprop train --convert-from`` on torchvision's video sources, through the command line:
a small mvit_v2_s and swin3d_t from a torchvision-layout weight file, trained on a video folder
through the coupling schedule (1, 0) -> (0, 1), then ``pareprop eval`` of the checkpoint on
the same clips; the refusals offline and of a file of another model; ``pareprop plan`` of the
converted models by name."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import pareprop.data.video
from pareprop.cli import main as cli
from pareprop.convert import CouplingSchedule
from pareprop.convert.swin3d import build_swin3d
from pareprop.convert.torchvision_mvit import published_mvit

pytest.importorskip("av")

from test_video_data import write_video  # noqa: E402

# Small builds of each source: a clip of 4 frames of 32 x 32, the first width 16. The same
# names (num_frames, img_size) reach both families' builders.
MVIT = dict(num_frames=4, img_size=32, embed_dim=16, max_run=1)
SWIN3D = dict(num_frames=4, img_size=32, embed_dim=16, depths=[2, 2], num_heads=[1, 2])
# What each source's published weights were trained on (their transforms, torchvision's
# docs): MViT 16 x 4 clips, mean 0.45 / std 0.225; Video Swin 32 x 2 clips, ImageNet's.
SOURCES = {
    "mvit_v2_s": (MVIT, dict(frame_stride=4, mean=[0.45] * 3, std=[0.225] * 3)),
    "swin3d_t": (SWIN3D, dict(frame_stride=2, mean=[0.485, 0.456, 0.406],
                              std=[0.229, 0.224, 0.225])),
}


def _model_args(kwargs):
    return [f"--model-arg={k}={json.dumps(v)}" for k, v in kwargs.items()]


def _torchvision_source(source, seed=0, **overrides):
    """torchvision's ``source`` at the small size, with Kinetics-400's 400 classes (as the
    publisher's file has them)."""
    torch.manual_seed(seed)
    kwargs = {**SOURCES[source][0], **overrides}
    if source.startswith("mvit"):
        frames, side = kwargs.pop("num_frames"), kwargs.pop("img_size")
        return published_mvit(source, temporal_size=frames, spatial_size=(side, side),
                              num_classes=400, **kwargs)
    kwargs.pop("num_frames"), kwargs.pop("img_size")
    return build_swin3d(source, num_classes=400, **kwargs)


def _save(model, path):
    """The model's state dict in torchvision's layout: .safetensors or torch.save."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    else:
        torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    # 8 frames at 30 fps: no longer than either source's clip span (4 frames x stride 2 or
    # 4), so the trainer's one validation view and eval's 5 views of a video are one clip,
    # and the two accuracies must agree.
    # The last validation video of class 1 looks like class 0's: the accuracies compared
    # below are not both 100% whatever the clips.
    root = tmp_path_factory.mktemp("videos")
    for split in ("train", "val"):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for j in range(2):
                write_video(folder / f"v{j}.mp4", frames=8, height=36, width=40,
                            base=100 * c + 7 * j)
    write_video(root / "val" / "class1" / "v2.mp4", frames=8, height=36, width=40, base=3)
    return root


class _FolderSpy:
    """Records the options every VideoFolder is built with, by mode."""

    def __init__(self, monkeypatch):
        self.built = []
        real = pareprop.data.video.VideoFolder
        spy = self

        class Recorded(real):
            def __init__(self, source, mode="train", **kwargs):
                super().__init__(source, mode, **kwargs)
                spy.built.append((mode, dict(
                    num_frames=self.num_frames, frame_stride=self.frame_stride,
                    crop_size=self.crop_size, mean=self.mean.flatten().tolist(),
                    std=self.std.flatten().tolist())))

        monkeypatch.setattr(pareprop.data.video, "VideoFolder", Recorded)

    def options(self, mode):
        found = [o for m, o in self.built if m == mode]
        assert found, f"no {mode} VideoFolder was built ({self.built})"
        return found


def _close(a, b):
    return all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))


@pytest.mark.parametrize("source,suffix", [("mvit_v2_s", ".pth"), ("swin3d_t", ".safetensors")])
def test_train_from_a_torchvision_file_then_eval_the_checkpoint(
        source, suffix, videos, tmp_path, monkeypatch, capsys):
    kwargs, expected = SOURCES[source]
    weights = _save(_torchvision_source(source), tmp_path / f"{source}{suffix}")
    initial = _torchvision_source(source).state_dict()
    spy = _FolderSpy(monkeypatch)
    couplings = []
    step = CouplingSchedule.step
    monkeypatch.setattr(CouplingSchedule, "step",
                        lambda self: couplings.append(step(self)) or couplings[-1])
    run = tmp_path / "run"
    rc = cli(["train", "--convert-from", source, "--pretrained-file", str(weights),
              "--dataset", str(videos), "--epochs", "2", "--batch-size", "2",
              "--coupling-steps", "3", "--device", "cpu", "--workers", "0", "--no-progress",
              "--out", str(run), *_model_args(kwargs)])
    assert rc == 0, capsys.readouterr().err

    # Trained through the whole schedule (4 steps, the coupling at (0, 1) from step 3), loss
    # finite, and from the file: AdamW's 4 steps of lr <= 2e-3 move the stem's weights
    # by a fraction of the distance between two random initialisations.
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    epochs, summary = [m for m in lines if m["type"] == "epoch"], lines[-1]
    assert [m["step"] for m in epochs] == [2, 4]
    assert all(math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"]) for m in epochs)
    meta = json.loads((run / "last" / "model.json").read_text())
    assert couplings[0] != (1.0, 0.0) and 0.0 < couplings[0][1] < 1.0  # on its way
    assert couplings[2:] == [(0.0, 1.0)] * 2  # reversible from step 3
    assert meta["model"]["kwargs"]["coupling"] == [0.0, 1.0]
    assert meta["model"]["kwargs"]["source"] == source
    from safetensors.torch import load_file

    trained = load_file(str(run / "last" / "model.safetensors"))
    stem = "conv_proj.weight" if source.startswith("mvit") else "patch_embed.proj.weight"
    fresh = _torchvision_source(source, seed=1).state_dict()[stem]
    moved, apart = (trained[stem] - initial[stem]).norm(), (fresh - initial[stem]).norm()
    assert moved < 0.25 * apart

    # Clips sampled as the source's weights were trained: its frame stride, mean and std, at
    # the frames and size the model was built for; validation alike.
    data_config = dict(input_size=[3, 4, 32, 32], **expected)
    assert meta["data_config"] == data_config
    train_options = spy.options("train")
    for options in train_options + spy.options("val"):
        assert options["num_frames"] == 4 and options["crop_size"] == 32
        assert options["frame_stride"] == expected["frame_stride"]
        assert _close(options["mean"], expected["mean"]) and _close(options["std"],
                                                                    expected["std"])

    # pareprop eval reads the same data config from the checkpoint, needs no initial weight
    # file any more (it may be moved or gone), and scores what training's validation scored.
    weights.unlink()
    spy.built.clear()
    out = tmp_path / "eval.json"
    rc = cli(["eval", "--checkpoint", str(run / "last"), "--data-dir", str(videos / "val"),
              "--device", "cpu", "--workers", "0", "--batch-size", "2", "--no-progress",
              "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["model"] == meta["model"]["name"] and result["videos"] == 5
    assert result["data_config"] == data_config
    assert spy.options("eval") == [train_options[0]]
    assert result["top1"] == pytest.approx(100 * summary["final_val_acc"])


def _stderr_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_offline_without_a_file_is_refused_in_one_line(source, videos, tmp_path, monkeypatch,
                                                       capsys):
    def offline(url, *args, **kwargs):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    # torchvision's download, as both sources' weights fetch it
    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", offline)
    rc = cli(["train", "--convert-from", source, "--dataset", str(videos), "--epochs", "1",
              "--batch-size", "2", "--device", "cpu", "--workers", "0", "--no-progress",
              "--out", str(tmp_path / "run"), *_model_args(SOURCES[source][0])])
    err = _stderr_line(capsys)
    assert rc == 2 and err.startswith("pareprop train: error:")
    assert "--pretrained-file" in err and "--from-scratch" in err and source in err
    assert not (tmp_path / "run" / "last").exists()


@pytest.mark.parametrize("source,other,message", [
    # mvit_v1_b's file for mvit_v2_s: other blocks (projections, no q/k norms)
    ("mvit_v2_s", dict(source="mvit_v1_b"), "another torchvision MViT"),
    # mvit_v2_s's own file at another depth (two blocks per run instead of one)
    ("mvit_v2_s", dict(max_run=2), "another torchvision MViT"),
    # swin3d_t's own file at another depth
    ("swin3d_t", dict(depths=[2, 4]), "swin3d_t state dict"),
])
def test_a_file_of_another_model_is_refused_in_one_line(source, other, message, videos,
                                                        tmp_path, capsys):
    if "source" in other:
        torch.manual_seed(0)
        wrong = published_mvit(other["source"], temporal_size=4, spatial_size=(32, 32),
                               embed_dim=16, max_run=1, num_classes=400)
    else:
        wrong = _torchvision_source(source, **other)
    path = _save(wrong, tmp_path / "wrong.pth")
    rc = cli(["train", "--convert-from", source, "--pretrained-file", str(path),
              "--dataset", str(videos), "--epochs", "1", "--batch-size", "2", "--device",
              "cpu", "--workers", "0", "--no-progress", "--out", str(tmp_path / "run"),
              *_model_args(SOURCES[source][0])])
    err = _stderr_line(capsys)
    assert rc == 2 and "does not fit" in err and message in err


def test_a_kinetics_file_loads_into_a_model_of_other_classes(tmp_path):
    # torchvision's MViT has no pretrained_cfg naming its classifier (head.1, behind a
    # dropout): a 400-class file was refused for a 2-class model instead of loaded with a
    # fresh head.
    import pareprop

    source = _torchvision_source("mvit_v2_s").eval()
    path = _save(source, tmp_path / "mvit_v2_s.pth")
    model = pareprop.create_model("converted_tv_mvit", source="mvit_v2_s",
                                  pretrained_file=str(path), num_classes=2, **MVIT).eval()
    reference = pareprop.convert(copy.deepcopy(source), tolerance=None).eval()
    x = model.example_inputs(1)[0]
    with torch.no_grad():  # torchvision's body, a fresh head
        assert torch.equal(model.forward_features(x), reference.forward_features(x))
    assert model(x).shape == (1, 2)


def test_mvit_clip_size_by_the_shared_names():
    import pareprop

    a = pareprop.create_model("converted_tv_mvit", tolerance=None, **MVIT)
    b = pareprop.create_model("converted_tv_mvit", tolerance=None, temporal_size=4,
                              spatial_size=[32, 32], embed_dim=16, max_run=1)
    assert a.pretrained_cfg["input_size"] == b.pretrained_cfg["input_size"] == (3, 4, 32, 32)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    with pytest.raises(ValueError, match="num_frames and temporal_size both set"):
        pareprop.create_model("converted_tv_mvit", num_frames=4, temporal_size=4)


@pytest.mark.slow  # plans full-width mvit_v2_s and swin3d_t (on fake tensors): 6-8 s
def test_plan_converted_video_models_by_name(tmp_path, capsys):
    out = tmp_path / "plan"
    rc = cli(["plan", "--models", "converted:mvit_v2_s", "converted:swin3d_t", "--engines",
              "reversible", "--batch-sizes", "2", "--num-frames", "4", "--img-size", "32",
              "--device", "cpu", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    records = [r for r in plan["records"] if r.get("batch_size") == 2]
    assert {r["model"] for r in records} == {"converted:mvit_v2_s", "converted:swin3d_t"}
    assert all(r["peak"] > r["parameters"] > 0 for r in records)


def test_plan_refuses_a_depth_the_source_has_not(tmp_path, capsys):
    rc = cli(["plan", "--models", "converted:swin3d_t", "--engines", "reversible",
              "--batch-sizes", "2", "--num-frames", "4", "--img-size", "32", "--depth", "4",
              "--device", "cpu", "--out", str(tmp_path / "plan")])
    err = _stderr_line(capsys)
    assert rc == 2 and "takes no depth argument" in err


def test_resume_needs_no_initial_weight_file(videos, tmp_path, capsys):
    # The run's checkpoint holds every weight the file gave (NOTE [ A checkpoint needs no
    # initial weight file ] in pareprop/checkpoint.py): resuming once read the file again.
    weights = _save(_torchvision_source("mvit_v2_s"), tmp_path / "mvit_v2_s.pth")
    run = tmp_path / "run"
    common = ["--dataset", str(videos), "--epochs", "2", "--batch-size", "2",
              "--coupling-steps", "3", "--device", "cpu", "--workers", "0", "--no-progress"]
    rc = cli(["train", "--convert-from", "mvit_v2_s", "--pretrained-file", str(weights),
              "--stop-after-epochs", "1", "--out", str(run), *common, *_model_args(MVIT)])
    assert rc == 0, capsys.readouterr().err
    weights.unlink()
    rc = cli(["train", "--resume", str(run), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").open()]
    assert 4 in steps
