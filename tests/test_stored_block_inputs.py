"""What a stored block keeps of its inputs: a stored block keeps its X1 only when the block below
it is recomputed (whose reconstruction needs it); block 0's X1 is the stack's input, which its
backward never rebuilds, so storing block 0 keeps the stack's X1 no longer than the caller does
(issue 39 item 5: this failed with a one-line mutant of the forward)."""

import weakref

import pytest
import torch

import pareprop
from test_engine import DIM, MixerBlock

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
@pytest.mark.parametrize("stored", [[0], [0, 1]])
def test_a_stored_block_0_does_not_keep_the_stacks_x1_alive(engine, stored):
    stack = pareprop.ReversibleStack([MixerBlock() for _ in range(3)], engine=engine)
    stack.store_blocks(stored)
    x1, x2 = torch.randn(2, 3, DIM), torch.randn(2, 3, DIM)  # the parameters require grad
    x1_alive = weakref.ref(x1)
    y1, y2 = stack(x1, x2)
    del x1
    assert x1_alive() is None  # the step holds what its backward needs, not the input
    (y1 * y2).sum().backward()
    assert all(p.grad is not None for p in stack.parameters())

