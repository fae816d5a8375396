"""The model catalog: a name (pareprop's or timm's) to a model, its inputs, facts and logits."""

from __future__ import annotations

import pytest
import torch

import pareprop
from pareprop import catalog
from pareprop.catalog import ModelRequest, build_model, example_inputs, model_facts

TIMM_TINY = dict(depth=1, img_size=32)  # vit_tiny_patch16_224 cut down for the CPU


def _bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["rev_vit_tiny_patch4_32", "rev_mvitv2_tiny_32"])
def test_a_plan_of_a_name_plans_the_model_create_model_builds(name):
    # Both default to 10 classes; a plan once gave them ImageNet's 1000-class head.
    model = pareprop.create_model(name)
    assert model.cfg.num_classes == 10
    plan = pareprop.plan_memory(name, 1, "autograd", device="cpu", optimizer="none")
    assert plan.parameters == _bytes(model)
    built = build_model(ModelRequest(name, "autograd"))
    assert {k: v.shape for k, v in built.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()}
    deeper = pareprop.plan_memory(name, 1, "autograd", device="cpu", optimizer="none",
                                  num_classes=100)
    assert deeper.parameters == _bytes(pareprop.create_model(name, num_classes=100))


def test_facts_of_pareprop_and_timm_models():
    rev = model_facts("rev_vit_tiny_patch4_32")
    assert (rev.source, rev.family, rev.reversible, rev.text) == ("pareprop", "RevViT", True,
                                                                 False)
    assert rev.depth == pareprop.create_model("rev_vit_tiny_patch4_32").cfg.depth
    assert rev.input_size == (3, 32, 32)
    text = model_facts("rev_roberta_small")
    assert text.text and text.reversible and len(text.input_size) == 1
    timm_vit = model_facts("vit_tiny_patch16_224")
    assert (timm_vit.source, timm_vit.family, timm_vit.reversible) == (
        "timm", "VisionTransformer", False)
    assert timm_vit.depth == 12 and timm_vit.cfg is None


def test_engine_modes_of_a_name():
    # A reversible model runs the engines and, against them, its own blocks checkpointed.
    assert catalog.engines_for("rev_vit_tiny_patch4_32", catalog.ALL_ENGINES) == [
        *pareprop.ENGINES, "checkpointed"]
    assert catalog.engines_for("vit_tiny_patch16_224", catalog.ALL_ENGINES) == [
        "plain", "checkpointed"]
    assert catalog.engine_budgets(["autograd", "reversible"], [None, 0.5, 0.5]) == [
        ("autograd", None), ("reversible", None), ("reversible", 0.5)]
    assert catalog.engine_label({"engine": "pareprop", "memory_budget": 0.25,
                                 "grad_checkpointing": True}) == "pareprop@0.25+ckpt"


def test_build_in_an_engine_or_a_baseline_mode_and_run_it():
    rev = build_model(ModelRequest("rev_vit_tiny_patch4_32", "pareprop", depth=3))
    assert rev.cfg.depth == 3 and rev.stack.engine == "pareprop"
    (x,) = example_inputs(rev, ModelRequest("rev_vit_tiny_patch4_32", "pareprop"), 2)
    assert x.shape == (2, 3, 32, 32)
    assert catalog.logits(rev(x)).shape == (2, 10)

    request = ModelRequest("vit_tiny_patch16_224", "checkpointed", num_classes=5, **TIMM_TINY)
    timm_vit = build_model(request)
    assert timm_vit.grad_checkpointing and len(timm_vit.blocks) == 1
    (x,) = example_inputs(timm_vit, request, 2)
    assert x.shape == (2, 3, 32, 32)
    assert catalog.logits(timm_vit(x)).shape == (2, 5)

    request = ModelRequest("rev_roberta_small", "autograd", seq_len=8,
                           overrides={"vocab_size": 64, "embed_dim": 32, "num_heads": 2})
    text = build_model(request)
    ids, mask = example_inputs(text, request, 3)
    assert ids.shape == mask.shape == (3, 8)
    assert catalog.logits(text(ids, mask)).shape[0] == 3


def test_bad_names_and_modes_say_what_to_do():
    with pytest.raises(ValueError, match="did you mean.*rev_vit_tiny_patch4_32.*timm"):
        catalog.model_source("rev_vit_tiny_patch4")
    with pytest.raises(ValueError, match="use its engine 'checkpointed'"):
        build_model(ModelRequest("vit_tiny_patch16_224", "plain", grad_checkpointing=True,
                                 **TIMM_TINY))
    with pytest.raises(ValueError, match="omit --depths"):
        build_model(ModelRequest("resnet18", "plain", depth=3))


def test_engine_auto_is_resolved_above_the_engine():
    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2)
    with pytest.raises(ValueError, match="pareprop.set_engine"):
        pareprop.engine.set_stack_engine(model, "auto")
    (x,) = model.example_inputs(2)
    pareprop.set_engine(model, "auto", memory_budget=1.0, example_inputs=(x,))
    assert model.memory_plan.num_stored == 2
