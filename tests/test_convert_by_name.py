"""Converted models by name: --convert-from's lookup, the source's state-dict names, and
``converted:SOURCE`` in the catalog (plans and benchmarks of a converted model beside its
source)."""

import pytest
import timm
import torch

import pareprop
from pareprop.catalog import ModelRequest, build_model, model_facts, model_source
from pareprop.convert import converted_model_name
from pareprop.convert.source import keep_source_names

SMALL = dict(depth=2, img_size=32, patch_size=8, embed_dim=16, num_heads=2)


def test_source_names_choose_the_converted_model():
    for name in ("vit_small_patch16_224", "deit_tiny_patch16_224", "deit3_small_patch16_224"):
        assert converted_model_name(name) == "converted_vit"
    with pytest.raises(ValueError, match="names no model pareprop converts.*converted_vit"):
        converted_model_name("no_such_model")


def test_state_dict_names_are_the_sources_both_ways():
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=3, **SMALL)
    model = pareprop.convert(vit)
    state = model.state_dict()
    assert list(state) == list(vit.state_dict())  # the source's names, in its order
    assert not any(k.startswith("stack.") for k in state)
    # The source's names load; so do our own parameter names (they are not renamed twice).
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    model.load_state_dict(zeros)
    assert all(p.abs().sum() == 0 for p in model.parameters())
    ours = {k: torch.ones_like(v) for k, v in model.named_parameters()}
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not unexpected
    assert all(p.eq(1).all() for p in model.stack.parameters())


def test_rename_rule_applies_inside_nested_names():
    # Swin-like layout: stages keep their blocks in a stack; the source has them directly.
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.Module()
            self.stack.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Stage(), Stage()])
    model.subblocks = torch.nn.Linear(2, 2)  # "blocks." inside a name, not after a dot: kept
    keep_source_names(model, [("stack.blocks.", "blocks.")])
    assert sorted(model.state_dict()) == [
        "layers.0.blocks.0.bias", "layers.0.blocks.0.weight",
        "layers.1.blocks.0.bias", "layers.1.blocks.0.weight",
        "subblocks.bias", "subblocks.weight"]
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    assert all(p.abs().sum() == 0 for p in model.parameters())


def test_catalog_builds_converted_names_at_the_reversible_coupling():
    assert model_source("converted:vit_small_patch16_224") == "converted"
    with pytest.raises(ValueError, match="names no model pareprop converts"):
        model_source("converted:resnet50")
    facts = model_facts("converted:vit_small_patch16_224")
    assert facts.reversible and facts.family == "ConvertedViT"
    request = ModelRequest("converted:vit_small_patch16_224", "reversible", img_size=32,
                           depth=2)
    model = build_model(request)
    assert pareprop.coupling_of(model) == (0.0, 1.0)
    assert model.stack.stored_blocks == () and getattr(model, "precision_guard", None) is None
    assert model.stack.engine == "reversible" and len(model.stack.blocks) == 2
    assert model.patch_embed.img_size == (32, 32)


def test_plan_of_a_converted_name_is_the_plan_of_the_model_it_names():
    by_name = pareprop.plan_memory("converted:vit_small_patch16_224", 4, "reversible",
                                   img_size=32, depth=2, device="cpu")
    explicit = pareprop.plan_memory("converted_vit", 4, "reversible", img_size=32, depth=2,
                                    source="vit_small_patch16_224", coupling=(0.0, 1.0),
                                    tolerance=None, device="cpu")
    stored = pareprop.plan_memory("converted:vit_small_patch16_224", 4, "reversible",
                                  img_size=32, depth=2, coupling=(1.0, 0.0), device="cpu")
    assert by_name.peak == explicit.peak
    assert by_name.activations < stored.activations  # at (1, 0) every block keeps its graph


@pytest.mark.parametrize("name,source,frames,stride", [
    ("converted_tv_mvit", "mvit_v2_s", 16, 4), ("converted_swin3d", "swin3d_t", 32, 2)])
def test_converted_video_sources_give_training_and_eval_one_data_config(name, source, frames,
                                                                        stride):
    # --convert-from a torchvision video source: the clips the trainer samples and pareprop
    # eval samples come from one config, the one of the weights' transforms.
    from pareprop.data import video_data_config

    with torch.device("meta"):
        model = pareprop.create_model(name, source=source, tolerance=None)
    config = video_data_config(model)
    assert config["input_size"][1] == frames and config["frame_stride"] == stride
    assert model.pretrained_cfg["frame_stride"] == stride
    assert list(config["mean"]) == list(model.pretrained_cfg["mean"])
