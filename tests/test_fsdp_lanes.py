"""FSDP2 prefetch under PaReprop: each block's explicit prefetch (``unshard(async_op=True)``) is
issued on the lane that later waits for it (NOTE [ FSDP prefetch on the waiting lane ] in
distributed/fsdp.py). On the CPU the lanes run in program order, but the engine keeps the lane id
of the work it queues (pareprop.engine.current_lane), which is what a GPU turns into streams.
One process with torch's "fake" process group at world size 2: the collectives do nothing, and
only where each unshard and each wait is queued is checked."""

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

import pareprop
from pareprop import engine as engine_module
from pareprop.distributed import fsdp
from pareprop.engine import lanes as lanes_module

try:  # torch's test helper; registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError:  # pragma: no cover - builds without it
    FakeStore = None

pytestmark = pytest.mark.skipif(
    FakeStore is None or not (tdist.is_available() and fsdp.fsdp_available()),
    reason="needs FSDP2 and torch's fake process group",
)


class Block(pareprop.ReversibleBlock):
    def __init__(self, dim=4):
        super().__init__()
        self.proj1, self.proj2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def f(self, x, **kwargs):
        return self.proj1(x)

    def g(self, x, **kwargs):
        return self.proj2(x)


class Model(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.stack = pareprop.ReversibleStack([Block() for _ in range(depth)], "pareprop")

    def forward(self, x):
        return torch.cat(self.stack(x, x), dim=-1)


@pytest.fixture
def fake_world():
    if tdist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def _record_unshards(monkeypatch, log):
    from torch.distributed.fsdp import FSDPModule

    unshard = FSDPModule.unshard

    def spy(self, async_op=False):
        handle = unshard(self, async_op=async_op)
        if async_op:
            log.append(("prefetch", self, engine_module.current_lane()))
            wait = handle.wait

            def logged_wait():
                log.append(("wait", self, engine_module.current_lane()))
                return wait()

            handle.wait = logged_wait
        return handle

    monkeypatch.setattr(FSDPModule, "unshard", spy)


@pytest.mark.parametrize("stored", [(), (2,), (1, 2)])
def test_each_prefetch_is_issued_on_the_lane_that_waits_for_it(fake_world, monkeypatch, stored):
    depth = 5
    torch.manual_seed(0)
    model = Model(depth)
    model.stack.store_blocks(stored)
    fsdp.shard(model)
    log = []
    _record_unshards(monkeypatch, log)
    x = torch.randn(2, 3, 4, requires_grad=True)
    model(x).sum().backward()

    index = {id(block): i for i, block in enumerate(model.stack.blocks)}
    lanes = lanes_module._block_lanes([i in stored for i in range(depth)])
    issued = {index[id(m)]: lane for kind, m, lane in log if kind == "prefetch"}
    waited = {index[id(m)]: lane for kind, m, lane in log if kind == "wait"}
    # Backward prefetches every block below the top one, and waits for each.
    assert sorted(issued) == sorted(waited) == list(range(depth - 1))
    for block in range(depth - 1):
        assert issued[block] == waited[block] == lanes[block], (
            f"block {block}: prefetch issued on lane {issued[block]}, waited for on lane "
            f"{waited[block]}, the block's lane is {lanes[block]}")
    assert model.stack.sharding.prefetch_on is None  # handed back after backward
