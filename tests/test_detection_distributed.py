"""DDP over two gloo processes trains a detector exactly: each engine's gradients equal one
process's over the same two shards.

NOTE [ The reference of a detector under DDP ]
A detector's losses are not sums over images: RPN and RoI heads sample anchors and proposals
with the global RNG and normalise by how many they sampled across the batch, so one process on
the combined batch is not what two processes compute. What DDP promises is the mean of the
processes' gradients: the reference is one process stepping each shard in turn, seeded as that
rank is, and averaging. The comparison covers the engines' gradient hooks under DDP's bucketed
all-reduce (every parameter reached, none twice).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

import pareprop
from _two_processes import on_two_processes
from pareprop.detection import create_detector
from pareprop.distributed import wrap_ddp
from pareprop.engine import ENGINES

pytestmark = [  # slow: spawned process pairs
    pytest.mark.slow,
    pytest.mark.skipif(not tdist.is_available(), reason="no torch.distributed"),
]

SIZE = 64
BACKBONE = dict(embed_dim=8, depth=5, last_block_indexes=[1, 2, 3, 4], window_size=8,
                kv_stride=2, img_size=SIZE, drop_path_rate=0.1)
HEADS = dict(min_size=SIZE, max_size=SIZE, rpn_pre_nms_top_n_train=40,
             rpn_post_nms_top_n_train=16, box_batch_size_per_image=8,
             rpn_batch_size_per_image=2048, heads="vitdet")


def _model(engine: str):
    torch.manual_seed(0)
    model = create_detector("maskrcnn", "rev_mvitv2_tiny", num_classes=3, engine=engine,
                            backbone_args=BACKBONE, fpn_channels=16, **HEADS)
    return model.double().train()


def _shard(rank: int, world: int = 2, per_rank: int = 2):
    """This rank's images and targets (boxes, labels, masks), float64."""
    g = torch.Generator().manual_seed(10 + rank)
    images, targets = [], []
    for _ in range(per_rank):
        images.append(torch.rand(3, SIZE, SIZE, generator=g, dtype=torch.float64))
        x0, y0 = torch.randint(0, SIZE // 2, (2,), generator=g).tolist()
        w, h = torch.randint(12, SIZE // 2, (2,), generator=g).tolist()
        mask = torch.zeros(1, SIZE, SIZE, dtype=torch.uint8)
        mask[:, y0 : y0 + h, x0 : x0 + w] = 1
        targets.append({"boxes": torch.tensor([[x0, y0, x0 + w, y0 + h]], dtype=torch.float64),
                        "labels": torch.tensor([1 + rank]), "masks": mask})
    return images, targets


def _grads(model, net, rank: int):
    images, targets = _shard(rank)
    torch.manual_seed(100 + rank)  # this rank's proposal sampling and drop path
    losses = net(images, targets)
    sum(losses.values()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _on_rank(rank, world):
    results = {}
    for engine in ENGINES:
        model = _model(engine)
        results[engine] = _grads(model, wrap_ddp(model), rank)
    model = pareprop.set_chunking(_model("reversible"), chunks=2)
    results["chunked"] = _grads(model, wrap_ddp(model), rank)
    return results


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("ddp_detection"))


@pytest.fixture(scope="module")
def reference():
    """NOTE [ The reference of a detector under DDP ]: the mean of the shards' gradients."""
    shards = []
    for rank in range(2):
        model = _model("autograd")
        shards.append(_grads(model, model, rank))
    return {n: (shards[0][n] + shards[1][n]) / 2 for n in shards[0]}


@pytest.mark.parametrize("setting", [*ENGINES, "chunked"])
def test_two_processes_equal_one_over_the_same_shards(ddp_results, reference, setting):
    for rank in range(2):
        got = ddp_results[rank][setting]
        assert set(got) == set(reference)
        for name, g in reference.items():
            torch.testing.assert_close(got[name], g, rtol=1e-7, atol=1e-10,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


def test_shards_differ(reference):
    """Control: the shards' gradients differ, so an all-reduce that is skipped (each rank
    keeping its own) would fail the comparison."""
    model = _model("autograd")
    g0 = _grads(model, model, 0)
    assert any(not torch.allclose(g0[n], reference[n]) for n in reference)
