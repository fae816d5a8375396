"""Data sets for training: digits shaping and split, CIFAR's missing-data message, image
folders, and the (seed, epoch) sampling that exact resume and multi-process runs rely on."""

import os

import pytest
import torch

from pareprop.data import DatasetNotFoundError, build_datasets, digits, epoch_sampler


def test_digits_shapes_split_and_normalisation():
    ds = digits(img_size=16, in_chans=3, seed=0, augment=False)
    assert ds.num_classes == 10
    assert len(ds.train) + len(ds.val) == 1797
    x, y = ds.train[0]
    assert x.shape == (3, 16, 16) and 0 <= y < 10
    # Channels are copies of the grey image; the training split is standardised.
    assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2])
    train = ds.train.images
    assert abs(train.mean().item()) < 1e-4 and abs(train.std().item() - 1) < 1e-3
    # All ten classes appear in validation.
    assert set(ds.val.labels.tolist()) == set(range(10))


def test_digits_split_is_fixed_by_seed():
    a, b, c = (digits(8, 1, seed=s, augment=False) for s in (0, 0, 1))
    assert torch.equal(a.val.images, b.val.images)
    assert not torch.equal(a.val.images, c.val.images)
    # Train and validation are disjoint: no validation image occurs in training.
    flat_train = {tuple(t.flatten().tolist()) for t in a.train.images}
    dup = sum(tuple(t.flatten().tolist()) in flat_train for t in a.val.images)
    assert dup <= 5  # the data set itself holds a few identical images


def test_digits_augmentation_replays_under_the_same_rng_state():
    ds = digits(16, 1, seed=0, augment=True)
    state = torch.get_rng_state()
    first = [ds.train[i][0] for i in range(8)]
    torch.set_rng_state(state)
    again = [ds.train[i][0] for i in range(8)]
    assert all(torch.equal(p, q) for p, q in zip(first, again))
    # and it does change images (a random shift), without changing the shape
    plain = digits(16, 1, seed=0, augment=False)
    assert any(not torch.equal(p, plain.train[i][0]) for i, p in enumerate(first))
    assert first[0].shape == (1, 16, 16)


def test_build_datasets_validates_input():
    with pytest.raises(ValueError, match="expected a square input size"):
        build_datasets("digits", (3, 16, 8))
    with pytest.raises(ValueError, match="digits, cifar10, cifar100 or a path"):
        build_datasets("mnist", (1, 8, 8))


def test_missing_cifar_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        build_datasets("cifar10", (3, 32, 32), data_dir=str(tmp_path))
    msg = str(e.value)
    assert "--download" in msg and "cifar10" in msg and str(tmp_path) in msg


def test_missing_image_folder(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="image folder"):
        build_datasets(str(tmp_path / "nope"), (3, 16, 16))


def test_image_folder_split_and_shapes(tmp_path):
    from PIL import Image

    for c, colour in enumerate(((255, 0, 0), (0, 0, 255))):
        os.makedirs(tmp_path / f"class{c}")
        for i in range(5):
            Image.new("RGB", (20 + i, 24), colour).save(tmp_path / f"class{c}" / f"{i}.png")
    ds = build_datasets(str(tmp_path), (3, 16, 16), seed=0)
    assert ds.num_classes == 2
    assert len(ds.train) + len(ds.val) == 10
    x, y = ds.val[0]
    assert x.shape == (3, 16, 16) and y in (0, 1)
    grey = build_datasets(str(tmp_path), (1, 16, 16), seed=0)
    assert grey.train[0][0].shape == (1, 16, 16)


def test_epoch_order_depends_on_seed_and_epoch_only():
    data = list(range(50))
    s1, s2 = epoch_sampler(data, seed=3), epoch_sampler(data, seed=3)
    s1.set_epoch(4)
    s2.set_epoch(4)
    assert list(s1) == list(s2)
    s2.set_epoch(5)
    assert list(s1) != list(s2)


def test_two_processes_cover_the_same_global_batches():
    # NOTE [ Batch size ] in trainer/setup.py: with micro-batch b/2 per process, the union of the
    # processes' k-th batches is the single process's k-th batch of size b.
    data, b = list(range(48)), 8
    one = epoch_sampler(data, seed=1)
    one.set_epoch(2)
    order = list(one)
    parts = []
    for rank in range(2):
        s = epoch_sampler(data, seed=1, num_replicas=2, rank=rank)
        s.set_epoch(2)
        parts.append(list(s))
    for k in range(len(data) // b):
        joint = parts[0][k * b // 2 : (k + 1) * b // 2] + parts[1][k * b // 2 : (k + 1) * b // 2]
        assert sorted(joint) == sorted(order[k * b : (k + 1) * b])


def test_empty_image_folder_says_what_is_wrong(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="<class>/<image>"):
        build_datasets(str(tmp_path), (3, 16, 16))
    os.makedirs(tmp_path / "class0")  # a class folder without images
    with pytest.raises(DatasetNotFoundError, match="<class>/<image>"):
        build_datasets(str(tmp_path), (3, 16, 16))
