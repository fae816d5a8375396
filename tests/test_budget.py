"""pareprop.set_memory_budget: the plan keeps its budget, spans reversible to autograd, and the
model it leaves still has exact gradients."""

import pytest
import torch

import pareprop
from pareprop.engine.testing import engine_errors, worst_error
from pareprop.memory import parse_memory as parse_bytes
from pareprop.memory.budget import parse_budget


def _vit(depth=6):
    torch.manual_seed(0)
    return pareprop.create_model(
        "rev_vit_tiny_patch4_32", img_size=16, embed_dim=16, depth=depth, num_heads=2,
        num_classes=5, drop_path_rate=0.2, engine="reversible",
    )


def _bytes(model, x, engine=None):
    if engine is not None:
        pareprop.set_engine(model, engine)
    return pareprop.activation_bytes(model, x)


def test_fractions_span_the_reversible_floor_to_autograd():
    model = _vit()
    x = model.example_inputs(4)[0]
    reversible = _bytes(model, x)
    none = pareprop.set_memory_budget(model, 0.0, x, cost="flops")
    assert none.num_stored == 0 and none.measured_bytes == none.floor_bytes == reversible
    every = pareprop.set_memory_budget(model, 1.0, x, cost="flops")
    assert every.num_stored == 6 and model.stack.engine == "autograd"
    model.stack.store_blocks([])
    assert every.measured_bytes == every.full_bytes == _bytes(model, x, "autograd")


def test_the_plan_keeps_its_budget_and_more_budget_stores_more():
    model = _vit()
    x = model.example_inputs(4)[0]
    kept, stored = [], []
    for fraction in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        plan = pareprop.set_memory_budget(model, fraction, x, cost="flops")
        assert plan.measured_bytes <= plan.budget_bytes
        assert plan.measured_bytes == _bytes(model, x)  # the plan is what the model now does
        assert abs(plan.predicted_bytes - plan.measured_bytes) <= 0.05 * plan.measured_bytes
        kept.append(plan.measured_bytes)
        stored.append(plan.num_stored)
    assert kept == sorted(kept) and stored == sorted(stored) and stored[0] == 0
    assert stored[-1] == 6 and 0 < stored[2] < 6
    # ViT's blocks are alike: the stored ones form one run at the top of the stack, and the
    # first block, which needs no kept input for a recomputed block below it, may join them.
    plan = pareprop.set_memory_budget(model, 0.5, x, cost="flops")
    top = tuple(i for i in plan.stored["stack"] if i > 0)
    assert top and top == tuple(range(6 - len(top), 6))
    # A budget in bytes, as a string.
    plan = pareprop.set_memory_budget(model, f"{plan.measured_bytes}B", x, cost="time")
    assert plan.measured_bytes <= plan.budget_bytes


def test_gradients_stay_exact_under_a_budget():
    model = _vit(5).double()
    x = model.example_inputs(2, dtype=torch.float64)[0]
    plan = pareprop.set_memory_budget(model, 0.5, x, cost="flops")
    assert 0 < plan.num_stored < 5
    report = engine_errors(model, (x,), engines=("reversible", "pareprop"))
    engine, key, err = worst_error(report)
    assert err < 1e-10, f"{engine} {key}: {err:.3e}"


def test_hierarchical_models_store_later_stages_first():
    torch.manual_seed(0)
    model = pareprop.create_model(
        "rev_mvitv2_tiny_32", embed_dim=16, depth=7, last_block_indexes=(0, 3, 6), num_classes=5,
        engine="reversible",
    )
    x = model.example_inputs(2)[0]
    plan = pareprop.set_memory_budget(model, 0.3, x, cost="flops")
    per_byte = {}
    for b in plan.blocks:
        per_byte.setdefault(b.stack, b.cost / b.kept_bytes)
    names = sorted(per_byte)  # stages.0.stack, stages.1.stack, stages.2.stack
    ratios = [per_byte[n] for n in names]
    assert ratios == sorted(ratios), ratios  # early stages hold more bytes per FLOP
    assert plan.stored[names[-1]] and not plan.stored[names[0]]


def test_budget_under_the_floor_names_the_floor():
    model = _vit()
    x = model.example_inputs(4)[0]
    floor = _bytes(model, x)
    with pytest.raises(ValueError, match=f"below the reversible floor .*\\({floor} bytes\\)"):
        pareprop.set_memory_budget(model, floor - 1, x)


def test_auto_engine_and_bad_arguments():
    model = _vit()
    x = model.example_inputs(2)[0]
    pareprop.set_engine(model, "autograd")
    state = torch.get_rng_state()
    pareprop.set_engine(model, "auto", memory_budget=0.5, example_inputs=x)
    assert torch.equal(state, torch.get_rng_state())  # measuring leaves the user's RNG alone
    assert model.stack.engine == "reversible" and model.memory_plan.num_stored > 0
    assert "stored" in str(model.memory_plan) and "floor" in str(model.memory_plan)
    assert model.memory_plan.to_dict()["stored"] == {"stack": list(model.stack.stored_blocks)}
    with pytest.raises(ValueError, match="needs memory_budget"):
        pareprop.set_engine(model, "auto")
    with pytest.raises(ValueError, match="goes with engine='auto'"):
        pareprop.set_engine(model, "reversible", memory_budget=0.5)
    with pytest.raises(ValueError, match="between 0"):
        pareprop.set_memory_budget(model, 1.5, x)
    with pytest.raises(ValueError, match="no ReversibleStack"):
        pareprop.set_memory_budget(torch.nn.Linear(2, 2), 0.5, torch.randn(1, 2))
    with pytest.raises(ValueError, match="cost must be"):
        pareprop.set_memory_budget(model, 0.5, x, cost="guess")


def test_parse_sizes_and_budgets():
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("8e10") == 8 * 10**10
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    for bad in ("12 parsecs", "-1GB", "", "GiB", "0"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    assert parse_budget(0.5) == ("fraction", 0.5)
    assert parse_budget("0.25") == ("fraction", 0.25)
    assert parse_budget("12GiB") == ("bytes", 12 * 2**30)
    assert parse_budget(4096) == ("bytes", 4096)
    assert parse_budget(0) == ("fraction", 0.0) and parse_budget(1) == ("fraction", 1.0)
