"""The one video data config (NOTE [ One video data config ] in pareprop/video.py), checked
value by value: the default frame stride, normalisation by the mean then the std in
``pareprop eval``, the input size the data config must share with the model, overrides
compared by value (a contradicting one refused, a tuple equal to the run's list accepted), the
generator a random clip start draws from, square frames, and image data sets refused for a
video model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.checkpoint import save_checkpoint
from pareprop.data import build_datasets
from pareprop.data.video import PUBLISHED_CONFIG, clip_indices, video_data_config
from pareprop.evaluate import evaluate

MODEL = "rev_mvit_base_16x4"
TINY = dict(num_frames=4, img_size=32, embed_dim=8, depth=4, transition_blocks=[2],
            kv_stride=[1, 4, 4])


class MeanLevel(nn.Module):
    """A two-class "video model" that says class 1 when the clip's mean value is above 0."""

    num_classes = 2

    def __init__(self, **cfg):
        super().__init__()
        self.pretrained_cfg = {**dict(input_size=[3, 2, 32, 32], mean=[0.5] * 3,
                                      std=[0.25] * 3), **cfg}

    def forward(self, x):  # (B, C, T, H, W)
        m = x.mean(dim=(1, 2, 3, 4))
        return torch.stack([-m, m], dim=-1)  # (B, 2)


def test_a_model_that_names_no_frame_stride_takes_every_4th_frame():
    assert video_data_config(MeanLevel())["frame_stride"] == 4  # PySlowFast's 16 x 4
    assert video_data_config(MeanLevel(frame_stride=2))["frame_stride"] == 2
    model = pareprop.create_model(MODEL, **TINY)
    assert video_data_config(model)["frame_stride"] == 4


def _flat_video(path, level, frames=8, side=32):
    import numpy as np

    av = pytest.importorskip("av")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        img = np.full((side, side, 3), level, dtype=np.uint8)
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_eval_normalises_by_the_models_mean_then_its_std(tmp_path):
    # Levels 96 and 191 of 255 are -0.49 and +1.0 normalised by mean 0.5, std 0.25: both
    # classified right. With mean and std swapped the dark videos give +0.25: called bright.
    pytest.importorskip("av")
    for name, level in (("a_dark", 96), ("b_bright", 191)):
        (tmp_path / name).mkdir()
        for j in range(2):
            _flat_video(tmp_path / name / f"{j}.mp4", level)
    result = evaluate(MeanLevel(), str(tmp_path), workers=0, device="cpu", progress=False)
    assert result["videos"] == 4
    assert result["data_config"]["mean"] == [0.5] * 3
    assert result["data_config"]["std"] == [0.25] * 3
    assert result["top1"] == 100.0


def test_a_data_config_of_another_input_size_is_refused(tmp_path):
    config = dict(PUBLISHED_CONFIG, input_size=[3, 8, 32, 32])
    with pytest.raises(ValueError, match=r"expected the data config's input_size to be the "
                                         r"model's \(3, 4, 32, 32\), got \(3, 8, 32, 32\)"):
        build_datasets(str(tmp_path), (3, 4, 32, 32), data_config=config)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "digits"])
def test_an_image_dataset_is_refused_for_a_video_model(name, tmp_path):
    with pytest.raises(ValueError, match=f"--dataset {name} holds images, and the model takes "
                                         r"clips \(3, 4, 32, 32\)"):
        build_datasets(name, (3, 4, 32, 32), data_dir=str(tmp_path))


def test_non_square_frames_are_refused():
    with pytest.raises(ValueError, match="square frames; MeanLevel has"):
        video_data_config(MeanLevel(input_size=[3, 2, 32, 48]))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A checkpoint of a video model trained (as the trainer records it) at mean 0.5 and std
    0.25 per channel, lists as JSON keeps them."""
    out = tmp_path_factory.mktemp("video_run")
    model = pareprop.create_model(MODEL, mean=[0.5] * 3, std=[0.25] * 3, **TINY)
    save_checkpoint(out, model, epoch=1, step=1,
                    extra={"data_config": video_data_config(model)})
    return out


def test_a_mean_override_that_contradicts_the_run_is_refused(run_dir):
    with pytest.raises(ValueError, match=r"mean=\[0.4, 0.4, 0.4\] contradicts the data config"):
        pareprop.load_model(run_dir / "last", mean=[0.4] * 3)
    with pytest.raises(ValueError, match=r"std=\(0.5, 0.5, 0.5\) contradicts the data config"):
        pareprop.load_model(run_dir / "last", std=(0.5,) * 3)


@pytest.mark.parametrize("mean", [(0.5, 0.5, 0.5), [0.5, 0.5, 0.5]])
def test_an_override_equal_to_the_run_is_accepted_as_tuple_or_list(run_dir, mean):
    model = pareprop.load_model(run_dir / "last", mean=mean, std=tuple([0.25] * 3))
    assert video_data_config(model)["mean"] == [0.5] * 3


def test_a_random_clip_start_draws_from_the_given_generator():
    def start(seed, global_seed):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        index = clip_indices(300, 30.0, 4, 2, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(torch.get_rng_state(), before)  # the default generator untouched
        return index.tolist()

    assert start(0, 1) == start(0, 2)
    assert len({tuple(start(seed, 1)) for seed in range(5)}) > 1  # and it is random
