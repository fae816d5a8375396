"""FX symbolic tracing, as torchvision's feature extraction and timm's FX tests trace models:
the traced module equals the model, under every engine, with the stack kept as one call."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from pareprop import ENGINES, ReversibleStack

TRACER_KWARGS = dict(
    leaf_modules=get_notrace_modules(),
    autowrap_functions=get_notrace_functions(),
    param_shapes_constant=True,
)
# Drop-path on everywhere, also in Rev-MViTv2's traced transitions: our DropPath uses its
# scaled mask (timm's scales it in place, ``div_``, a node whose result is unused, which the
# feature extractor's dead-code elimination removes: timm's test_vit differs by 6e-2 so).
TINY = {
    "rev_vit_tiny_patch4_32": dict(
        embed_dim=16, depth=3, num_heads=2, img_size=16, drop_path_rate=0.2
    ),
    "rev_mvitv2_tiny_32": dict(embed_dim=8, img_size=32, drop_path_rate=0.2),
    "rev_mvit_base": dict(embed_dim=8, img_size=32, depth=4, transition_blocks=(2,),
                          drop_path_rate=0.2),
    "rev_swin_tiny_32": dict(
        embed_dim=8,
        depths=(1, 2, 1),
        num_heads=(1, 1, 2),
        window=4,
        img_size=30,
        drop_path_rate=0.2,
    ),
    "rev_mvit_base_16x4": dict(num_frames=4, embed_dim=8, img_size=32, depth=4,
                               transition_blocks=(2,), kv_stride=(1, 4, 4), drop_path_rate=0.2),
}


def _model(name: str, engine: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        name, dtype=torch.float64, engine=engine, num_classes=5, **TINY[name]
    )


def _traced(model: torch.nn.Module) -> torch.fx.GraphModule:
    """The whole model as timm's tests trace it: one output node, the logits."""
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=TRACER_KWARGS)
    return create_feature_extractor(
        model,
        train_return_nodes=[train_nodes[-1]],
        eval_return_nodes=[eval_nodes[-1]],
        tracer_kwargs=TRACER_KWARGS,
    )


def _images(model: torch.nn.Module) -> torch.Tensor:
    (x,) = model.example_inputs(2, dtype=torch.float64)
    return x


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(TINY))
def test_traced_training_step_equals_autograd(name, engine):
    reference = _model(name, "autograd").train()  # same weights: same seed
    traced = _traced(_model(name, engine).train()).train()
    x = _images(reference)
    torch.manual_seed(1)  # drop-path masks: the traced graph draws them in the same order
    expected = reference(x)
    expected.square().sum().backward()
    grads = dict(reference.named_parameters())
    torch.manual_seed(1)
    (out,) = traced(x).values()
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    params = dict(traced.named_parameters())
    assert len(params) == len(grads)
    for n, p in params.items():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", list(TINY))
def test_stacks_stay_single_calls_that_run_their_engine(name):
    model = _model(name, "reversible")
    traced = _traced(model.train())
    stacks = {n for n, m in model.named_modules() if isinstance(m, ReversibleStack)}
    called = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    # Swin's stages are leaves themselves (their masks are sized in Python), so their stacks
    # run inside them; elsewhere every stack is a node of its own.
    inside_leaf = {s for s in stacks if any(s.startswith(c + ".") for c in called)}
    assert stacks - inside_leaf <= called
    assert stacks, "the model has reversible stacks"
    for node_name, module in traced.named_modules():
        if isinstance(module, ReversibleStack):
            assert module.engine == "reversible", node_name


@pytest.mark.parametrize("name", list(TINY))
def test_traced_eval_equals_the_model_and_still_checks_input(name):
    model = _model(name, "pareprop").eval()
    traced = _traced(model).eval()
    x = _images(model)
    with torch.inference_mode():
        (out,) = traced(x).values()
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected"):
        traced(x[:, :1])
