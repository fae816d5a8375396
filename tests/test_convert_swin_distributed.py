"""Converted Swin, Swin V2 (timm's; torchvision's V2) and Video Swin under DDP and FSDP2 (2
gloo processes, float64): at (alpha, beta) = (0.3, 0.5), every engine, several stacks with
checkpointed patch merging between them, one SGD step equals one process on the whole batch
with plain autograd."""

import pytest
import torch
import torch.distributed as tdist

import pareprop
from _two_processes import on_two_processes, sgd_step
from pareprop.convert.swin3d import build_swin3d
from pareprop.convert.torchvision_swin import build_tv_swin
from pareprop.distributed import fsdp, wrap_ddp
from pareprop.engine import ENGINES

pytestmark = [  # slow: spawned process pairs (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(
        not (tdist.is_available() and fsdp.fsdp_available()), reason="no FSDP2 in this torch"
    ),
]

BATCH, LR = 4, 0.5
TIMM = dict(img_size=16, patch_size=2, embed_dim=8, depths=(2, 2), num_heads=(1, 2),
            window_size=4, num_classes=5, drop_path_rate=0.0)  # processes draw apart


def _source(family):
    if family == "swin3d":
        return build_swin3d("swin3d_t", embed_dim=8, depths=[2, 2], num_heads=[1, 2],
                            num_classes=5, stochastic_depth_prob=0.0)
    if family == "tv_swinv2":  # torchvision's post-norm V2: shifted 4 x 4 windows on 8 x 8
        return build_tv_swin("swin_v2_t", embed_dim=8, depths=[2, 2], num_heads=[1, 2],
                             window_size=[4, 4], num_classes=5, stochastic_depth_prob=0.0)
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    return (SwinTransformerV2 if family == "swinv2" else SwinTransformer)(**TIMM)


def _model(family, engine):
    torch.manual_seed(0)
    model = pareprop.convert(_source(family), engine=engine, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    model.set_grad_checkpointing(True)
    return model.double().train()


def _batch(family):
    g = torch.Generator().manual_seed(1)
    shape = {"swin3d": (BATCH, 3, 4, 16, 16), "tv_swinv2": (BATCH, 3, 32, 32)}.get(
        family, (BATCH, 3, 16, 16))
    return torch.randn(shape, generator=g, dtype=torch.float64), \
        torch.randint(0, 5, (BATCH,), generator=g)


def _cases():
    for family in ("swin", "swinv2", "swin3d", "tv_swinv2"):
        for engine in ENGINES:
            for wrapper in ("ddp", "fsdp"):
                yield family, engine, wrapper


def _on_rank(rank, world):
    results = {}
    for family, engine, wrapper in _cases():
        x, y = _batch(family)
        xs, ys = x[rank::world], y[rank::world]
        model = _model(family, engine)
        if wrapper == "ddp":
            results[(family, engine, wrapper)] = sgd_step(model, wrap_ddp(model), xs, ys, LR)
        else:
            fsdp.shard(model)
            results[(family, engine, wrapper)] = sgd_step(model, model, xs, ys, LR)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("swin_dist"))


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: "-".join(c))
def test_two_processes_equal_one(results, case):
    family = case[0]
    x, y = _batch(family)
    model = _model(family, "autograd")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = sgd_step(model, model, x, y, LR)
    for rank in range(2):
        got = results[rank][case]
        for name, want in ref.items():
            moved = (want - before[name]).norm().item()
            err = (got[name] - want).norm().item() / max(moved, 1e-30)
            assert err < 1e-10, f"rank {rank}, {name}: relative error {err:.2e} of the update"
