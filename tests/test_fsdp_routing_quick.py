"""FSDP2's routing of a unit's other forward methods (NOTE [ FSDP units called through other
methods ] in pareprop/fsdp.py), quickly: one process, a gloo group of one, a tiny model. Called
from outside, ``forward_features`` and ``forward_head`` gather the unit and compute what the
unsharded model computes; a forward (or such a method) that raises leaves the routing as it
was, so the next call from outside still gathers."""

import pytest
import torch
import torch.distributed as tdist

import pareprop
from pareprop.distributed import fsdp

pytestmark = pytest.mark.skipif(
    not (tdist.is_available() and fsdp.fsdp_available()
         and fsdp._forward_method_registrar() is not None),
    reason="needs FSDP2 with register_fsdp_forward_method",
)

# The transition block (a unit of its own) runs through forward_chunk, which its forward calls.
TINY = dict(img_size=32, embed_dim=8, depth=5, num_classes=3, transition_blocks=(2,))


@pytest.fixture
def one_process():
    if tdist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def _models(engine):
    torch.manual_seed(0)
    plain = pareprop.create_model("rev_mvit_base", engine=engine, **TINY).eval()
    sharded = pareprop.create_model("rev_mvit_base", engine=engine, **TINY).eval()
    sharded.load_state_dict(plain.state_dict())
    return plain, fsdp.shard(sharded)


def _transition(model):
    (name,) = [n for n, m in model.named_modules() if type(m).__name__.endswith("Transition")]
    return name


@pytest.mark.parametrize("engine", ["autograd", "reversible"])
def test_methods_called_from_outside_gather_even_after_a_forward_raised(one_process, engine):
    plain, sharded = _models(engine)
    name = _transition(plain)
    block, unit = plain.get_submodule(name), sharded.get_submodule(name)
    assert unit in fsdp._units(sharded) and fsdp.is_wrapper(unit)
    x = torch.randn(2, 3, 32, 32)
    inputs = []
    block.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    with torch.no_grad():
        ref_logits = plain(x)
        ref_block = block.forward_chunk(inputs[0], None)
        # (FSDP2 starts from a forward of the root.)
        torch.testing.assert_close(sharded(x), ref_logits, rtol=0, atol=0)
        # Called from outside the unit's __call__, the method gathers the unit.
        torch.testing.assert_close(unit.forward_chunk(inputs[0], None), ref_block,
                                   rtol=0, atol=0)
        # The unit's forward raises (a 2-D input), and so does the method called from outside.
        with pytest.raises(ValueError):
            unit(torch.randn(2, 8))
        with pytest.raises(ValueError):
            unit.forward_chunk(torch.randn(2, 8), None)
        # A whole forward (which reshards the unit after it), then the method from outside:
        # still routed through the gather, not left as the plain method of an unsharded unit.
        torch.testing.assert_close(sharded(x), ref_logits, rtol=0, atol=0)
        torch.testing.assert_close(unit.forward_chunk(inputs[0], None), ref_block,
                                   rtol=0, atol=0)
        torch.testing.assert_close(sharded.forward_features(x), plain.forward_features(x),
                                   rtol=0, atol=0)
