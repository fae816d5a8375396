"""FSDP2 per block (pareprop.fsdp.shard) on the CPU: 2 gloo processes, float64. For every engine
and one model of each family, a sharded step on half batches equals one process on the whole
batch: full gradients gathered from the shards, weights after an SGD step, with gradient
accumulation and with one stored block; each rank holds about half of the bytes."""

import os

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

import pareprop
from pareprop import fsdp
from pareprop.engine import ENGINES

pytestmark = pytest.mark.skipif(
    not (tdist.is_available() and fsdp.fsdp_available()), reason="no FSDP2 in this torch"
)

BATCH, LR = 8, 0.5
# One tiny model of each family; depth 3 (odd) where a family allows it.
FAMILIES = {
    "vit": ("rev_vit_tiny_patch4_32", dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16,
                                           depth=3, num_heads=2)),
}


def _model(family, engine):
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    return pareprop.create_model(name, engine=engine, **kwargs).double().train()


def _batch(family):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def _grads_and_step(model, batches, full=lambda t: t):
    """Loss-mean gradients over ``batches`` (micro-batches of one step), then one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y) / len(batches)
        loss.backward()
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
    opt.step()
    weights = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return grads, weights


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_bytes(model):
    return sum(_full_local(p).numel() * p.element_size() for p in model.parameters())


def _full_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _cases():
    for family in FAMILIES:
        for engine in ENGINES:
            yield family, engine, "plain"
        yield family, "reversible", "accum"
        yield family, "pareprop", "stored"
        yield family, "pareprop", "late_reduce"


def _worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                             world_size=world)
    try:
        results = {}
        for family, engine, variant in _cases():
            x, y = _batch(family)
            xs, ys = x[rank::world], y[rank::world]  # this process's half
            model = _model(family, engine)
            if variant == "stored":
                for stack in model.modules():
                    if isinstance(stack, pareprop.ReversibleStack):
                        stack.store_blocks([1])
            full_bytes = _local_bytes(model)
            fsdp.shard(model)
            half = len(ys) // 2
            if variant == "accum":
                micro = [(xs[:half], ys[:half]), (xs[half:], ys[half:])]
            else:
                micro = [(xs, ys)]
            fsdp.ENABLE_EARLY_REDUCE = variant != "late_reduce"
            try:
                # FSDP averages over processes; the loss is a mean over each half already.
                grads, weights = _grads_and_step(model, micro, _full)
            finally:
                fsdp.ENABLE_EARLY_REDUCE = True
            results[(family, engine, variant)] = (grads, weights,
                                                  _local_bytes(model) / full_bytes)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _reference(family, variant):
    x, y = _batch(family)
    model = _model(family, "autograd")
    return _grads_and_step(model, [(x, y)])


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: "-".join(c))
def test_sharded_step_matches_one_process(fsdp_results, case):
    family, engine, variant = case
    ref_grads, ref_weights = _reference(family, variant)
    for rank in range(2):
        grads, weights, _ = fsdp_results[rank][case]
        assert set(grads) == set(ref_grads)
        for name in ref_grads:
            assert _rel(grads[name], ref_grads[name]) < 1e-10, (rank, name)
            assert _rel(weights[name], ref_weights[name]) < 1e-10, (rank, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_holds_half_the_parameters(fsdp_results, family):
    for rank in range(2):
        ratio = fsdp_results[rank][(family, "pareprop", "plain")][2]
        assert 0.4 < ratio < 0.6, ratio
