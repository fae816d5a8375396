"""The scaled coupling under DDP and FSDP2 (2 gloo processes, float64): a converted ViT at
(alpha, beta) = (0.3, 0.5), every engine, one stored block, equals one process on the whole
batch with plain autograd."""

import pytest
import torch
import torch.distributed as tdist
from timm.models.vision_transformer import VisionTransformer

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

SMALL = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, num_heads=2, num_classes=5,
             depth=3, reg_tokens=1, init_values=0.5)
BATCH, LR = 8, 0.5


def _model(engine, stored=()):
    torch.manual_seed(0)
    model = pareprop.convert(VisionTransformer(**SMALL), engine=engine, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    model.stack.store_blocks(stored)
    return model.double().train()


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 5, (BATCH,), generator=g)


def _cases():
    for engine in ENGINES:
        yield engine, "ddp", ()
        yield engine, "fsdp", ()
    yield "pareprop", "fsdp", (1,)


def _on_rank(rank, world):
    x, y = _batch()
    xs, ys = x[rank::world], y[rank::world]
    results = {}
    for engine, wrapper, stored in _cases():
        model = _model(engine, stored)
        if wrapper == "ddp":
            results[(engine, wrapper, stored)] = sgd_step(model, wrap_ddp(model), xs, ys, LR)
        else:
            fsdp.shard(model)
            results[(engine, wrapper, stored)] = sgd_step(model, model, xs, ys, LR)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("coupling_dist"))


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_two_processes_equal_one_with_a_scaled_coupling(results, case):
    x, y = _batch()
    model = _model("autograd")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = sgd_step(model, model, x, y, LR)
    for rank in range(2):
        got = results[rank][case]
        for name, want in ref.items():
            moved = (want - before[name]).norm().item()
            err = (got[name] - want).norm().item() / max(moved, 1e-30)
            assert err < 1e-10, f"rank {rank}, {name}: relative error {err:.2e} of the update"
