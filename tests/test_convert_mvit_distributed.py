"""Converted MViTs under DDP and FSDP2 (2 gloo processes, float64): timm's MViTv2 and
torchvision's MViT at (alpha, beta) = (0.3, 0.5), several stacks and the blocks kept from the
source, every engine, one stored block, equal one process on the whole batch with plain
autograd."""

import pytest
import torch
import torch.distributed as tdist

import pareprop
from _two_processes import on_two_processes, sgd_step
from pareprop.distributed import fsdp, wrap_ddp
from pareprop.engine import ENGINES

pytestmark = [  # slow: spawned process pairs (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(
        not (tdist.is_available() and fsdp.fsdp_available()), reason="no FSDP2 in this torch"
    ),
]

FAMILIES = {
    "mvitv2": dict(name="converted_mvitv2", source="mvitv2_small_cls", depths=(1, 2, 1, 2),
                   embed_dim=8, img_size=32),
    "tv_mvit": dict(name="converted_tv_mvit", source="mvit_v2_s", spatial_size=(32, 32),
                    temporal_size=4, embed_dim=8, max_run=2,
                    dropout=0.0, stochastic_depth_prob=0.0),  # torchvision's are 0.5 and 0.2
}
BATCH, LR = 4, 0.5


def _model(family, engine, stored=False):
    torch.manual_seed(0)
    kwargs = dict(FAMILIES[family])
    model = pareprop.create_model(kwargs.pop("name"), num_classes=5, engine=engine,
                                  tolerance=None, coupling=(0.3, 0.5), **kwargs)
    if stored:
        model.stacks()[-1].store_blocks([0])
    return model.double().train()


def _batch(family):
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, 3, 32, 32) if family == "mvitv2" else (BATCH, 3, 4, 32, 32)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(
        0, 5, (BATCH,), generator=g)


def _cases():
    for family in FAMILIES:
        for engine in ENGINES:
            yield family, engine, "ddp", False
            yield family, engine, "fsdp", False
        yield family, "pareprop", "fsdp", True


def _on_rank(rank, world):
    results = {}
    for family, engine, wrapper, stored in _cases():
        x, y = _batch(family)
        xs, ys = x[rank::world], y[rank::world]
        model = _model(family, engine, stored)
        if wrapper == "ddp":
            net = wrap_ddp(model)
        else:
            net = fsdp.shard(model)
        results[(family, engine, wrapper, stored)] = sgd_step(model, net, xs, ys, LR)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("convert_mvit_dist"))


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: "-".join(map(str, c)))
def test_two_processes_equal_one(results, case):
    family = case[0]
    x, y = _batch(family)
    model = _model(family, "autograd")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = sgd_step(model, model, x, y, LR)
    # The key norm's bias gets no gradient (softmax ignores a shift shared by every key): its
    # update is rounding noise, measured against the largest update instead.
    largest = max((ref[n] - before[n]).norm().item() for n in ref)
    for rank in range(2):
        got = results[rank][case]
        assert got.keys() == ref.keys()
        for name, want in ref.items():
            moved = (want - before[name]).norm().item()
            err = (got[name] - want).norm().item() / max(moved, 1e-6 * largest)
            assert err < 1e-10, f"rank {rank}, {name}: relative error {err:.2e} of the update"
